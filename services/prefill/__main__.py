"""``python -m tandem.services.prefill '<WorkerSpec JSON>'``: a prefill worker process."""

from __future__ import annotations

import sys

from tandem.services.control.process import WorkerSpec, worker_main
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.kv_transfer.transport import KVTransport
from tandem.services.prefill.config import PrefillConfig
from tandem.services.prefill.service import prefill_handlers
from tandem.services.prefill.worker import PrefillWorker


def build(engine: LLMEngine, transport: KVTransport, spec: WorkerSpec) -> PrefillWorker:
    return PrefillWorker(engine, transport, PrefillConfig(**spec.role), spec.worker_id)


if __name__ == "__main__":
    sys.exit(worker_main(None, __doc__ or "", build, prefill_handlers))
