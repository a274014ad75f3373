"""``python -m services.prefill '<WorkerSpec JSON>'``: a prefill worker process."""

from __future__ import annotations

import sys

from services.control.process import WorkerSpec, worker_main
from services.engine.llm_engine import LLMEngine
from services.kv_transfer.transport import KVTransport
from services.prefill.config import PrefillConfig
from services.prefill.service import prefill_handlers
from services.prefill.worker import PrefillWorker


def build(engine: LLMEngine, transport: KVTransport, spec: WorkerSpec) -> PrefillWorker:
    return PrefillWorker(engine, transport, PrefillConfig(**spec.role), spec.worker_id)


if __name__ == "__main__":
    sys.exit(worker_main(None, __doc__ or "", build, prefill_handlers))
