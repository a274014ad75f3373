"""``python -m services.decode '<WorkerSpec JSON>'``: a decode worker process."""

from __future__ import annotations

import sys

from services.control.process import WorkerSpec, worker_main
from services.decode.config import DecodeConfig
from services.decode.service import decode_handlers
from services.decode.worker import DecodeWorker
from services.engine.llm_engine import LLMEngine
from services.kv_transfer.transport import KVTransport


def build(engine: LLMEngine, transport: KVTransport, spec: WorkerSpec) -> DecodeWorker:
    return DecodeWorker(engine, transport, DecodeConfig(**spec.role), spec.worker_id)


if __name__ == "__main__":
    sys.exit(worker_main(None, __doc__ or "", build, decode_handlers))
