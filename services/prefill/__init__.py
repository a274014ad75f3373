"""Prefill worker: chunked prefill, the first token, and the prompt's KV held under a lease."""

from services.prefill.config import PrefillConfig
from services.prefill.leases import Lease, LeaseTable
from services.prefill.metrics import PrefillMetrics
from services.prefill.result import PrefillResult
from services.prefill.worker import PrefillWorker

__all__ = ["Lease", "LeaseTable", "PrefillConfig", "PrefillMetrics", "PrefillResult",
           "PrefillWorker"]
