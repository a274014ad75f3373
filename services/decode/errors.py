from __future__ import annotations


class DecodeRejectedError(RuntimeError):
    """The decode worker would not take the request (no capacity, shutting down); the
    prefill worker was told to free its blocks. Another decode worker may take it."""


class KVTransferFailedError(RuntimeError):
    """The prompt's KV could not be pulled and the worker is configured not to recompute."""
