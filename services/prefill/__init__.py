"""Prefill worker: chunked prefill, the first token, and the prompt's KV held under a lease."""
