"""Decode worker: imports a prompt's KV from a prefill worker, then continuous batching."""
