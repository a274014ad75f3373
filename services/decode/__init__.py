"""Decode worker: imports a prompt's KV from a prefill worker, then continuous batching."""

from services.decode.config import DecodeConfig
from services.decode.errors import DecodeRejectedError, KVTransferFailedError
from services.decode.metrics import DecodeMetrics
from services.decode.worker import DecodeResult, DecodeStream, DecodeWorker, KVSource

__all__ = ["DecodeConfig", "DecodeMetrics", "DecodeRejectedError", "DecodeResult",
           "DecodeStream", "DecodeWorker", "KVSource", "KVTransferFailedError"]
