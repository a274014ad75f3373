"""The decode worker on the control channel: server handlers and the client (RemoteDecode)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from tandem.loadtest.rpc_workers.codec import request_from_dict, request_to_dict, token_ids
from tandem.loadtest.rpc_workers.prefill import RemotePrefill
from tandem.loadtest.rpc_workers.process import WorkerSpec, worker_main
from tandem.loadtest.rpc_workers.rpc import Handler, RpcClient
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.handoff.decode import DecodeConfig, DecodeResult, DecodeWorker, KVSource
from tandem.services.handoff.pairing import PairingError, PairingInfo
from tandem.services.handoff.staging import TransferArea
from tandem.services.kv_transfer.transport import KVTransport
from tandem.services.protocol.handoff import ClusterKey
from tandem.services.protocol.outputs import (
    DecodeRejectedError,
    EngineOverloadedError,
    KVTransferFailedError,
    RequestError,
)
from tandem.services.protocol.request import GenerationRequest


class RequestAbortedError(RuntimeError):
    """The request was aborted while the call waited for it."""


ERRORS: dict[str, type[Exception]] = {
    "PairingError": PairingError, "RequestError": RequestError,
    "EngineOverloadedError": EngineOverloadedError, "DecodeRejectedError": DecodeRejectedError,
    "KVTransferFailedError": KVTransferFailedError, "RequestAbortedError": RequestAbortedError,
}


def decode_handlers(worker: DecodeWorker) -> dict[str, Handler]:
    running: dict[str, asyncio.Task[DecodeResult]] = {}

    async def pair_prefill(p: dict[str, Any]) -> Any:
        peer = RemotePrefill(str(p["host"]), int(p["port"]), worker.transport.key,
                             worker.worker_id)
        return (await worker.pair(peer)).to_dict()

    async def generate(p: dict[str, Any]) -> Any:
        request = request_from_dict(p["request"])
        request_id = request.request_id
        task = asyncio.ensure_future(worker.generate(request))
        running[request_id] = task
        try:
            result = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # our caller hung up
            raise RequestAbortedError(f"request {request_id!r} was aborted") from None
        finally:
            running.pop(request_id, None)
        return {"request_id": result.request_id, "output_token_ids": result.output_token_ids,
                "finish_reason": result.finish_reason, "kv_source": str(result.kv_source)}

    async def abort(p: dict[str, Any]) -> Any:
        task = running.get(str(p["request_id"]))
        if task is None:
            return False
        task.cancel()
        return True

    async def drain(p: dict[str, Any]) -> Any:
        worker.drain()
        return True

    async def status(p: dict[str, Any]) -> Any:
        return await worker.status()

    return {"pair_prefill": pair_prefill, "generate": generate, "abort": abort,
            "drain": drain, "status": status}


class RemoteDecode:
    """A decode worker in another process (``key``, ``name``: as for RemotePrefill)."""

    def __init__(self, host: str, port: int, key: ClusterKey | None = None,
                 name: str = "gateway") -> None:
        self.rpc = RpcClient(host, port, ERRORS, key=key, name=name)

    async def pair_prefill(self, host: str, port: int) -> PairingInfo:
        """Have the decode worker pair with the prefill worker serving at host:port."""
        return PairingInfo.from_dict(await self.rpc.call("pair_prefill",
                                                         {"host": host, "port": port}))

    async def generate(self, request: GenerationRequest) -> DecodeResult:
        result = await self.rpc.call("generate", {"request": request_to_dict(request)})
        return DecodeResult(str(result["request_id"]), token_ids(result["output_token_ids"]),
                            result["finish_reason"], KVSource(result["kv_source"]))

    async def abort(self, request_id: str) -> bool:
        return bool(await self.rpc.call("abort", {"request_id": request_id}))

    async def drain(self) -> None:
        await self.rpc.call("drain")

    async def status(self) -> dict[str, Any]:
        return dict(await self.rpc.call("status"))

    async def close(self) -> None:
        await self.rpc.close()


def build(engine: LLMEngine, transport: KVTransport, spec: WorkerSpec, area: TransferArea
          ) -> DecodeWorker:
    return DecodeWorker(engine, transport, DecodeConfig(**spec.role), spec.worker_id, area=area)


if __name__ == "__main__":
    USAGE = "python -m tandem.loadtest.rpc_workers.decode '<WorkerSpec JSON>'"
    sys.exit(worker_main(None, USAGE, build, decode_handlers))
