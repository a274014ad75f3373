"""``python -m tandem.services.decode '<WorkerSpec JSON>'``: a decode worker process."""

from __future__ import annotations

import sys

from tandem.services.control.process import WorkerSpec, worker_main
from tandem.services.decode.config import DecodeConfig
from tandem.services.decode.service import decode_handlers
from tandem.services.decode.worker import DecodeWorker
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.kv_transfer.transport import KVTransport


def build(engine: LLMEngine, transport: KVTransport, spec: WorkerSpec) -> DecodeWorker:
    return DecodeWorker(engine, transport, DecodeConfig(**spec.role), spec.worker_id)


if __name__ == "__main__":
    sys.exit(worker_main(None, __doc__ or "", build, decode_handlers))
