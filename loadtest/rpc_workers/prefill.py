"""The prefill worker on the control channel: server handlers and the client (RemotePrefill)."""

from __future__ import annotations

import sys
from typing import Any

from tandem.loadtest.rpc_workers.codec import request_from_dict, request_to_dict
from tandem.loadtest.rpc_workers.process import WorkerSpec, worker_main
from tandem.loadtest.rpc_workers.rpc import Handler, RpcClient
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.handoff.pairing import PairingError, PairingInfo
from tandem.services.handoff.prefill import PrefillConfig, PrefillWorker
from tandem.services.handoff.staging import TransferArea
from tandem.services.kv_transfer.transport import KVTransport
from tandem.services.protocol.handoff import ClusterKey, PrefillResult
from tandem.services.protocol.outputs import EngineOverloadedError, RequestError
from tandem.services.protocol.request import GenerationRequest

ERRORS: dict[str, type[Exception]] = {
    "PairingError": PairingError, "RequestError": RequestError,
    "EngineOverloadedError": EngineOverloadedError,
}


def prefill_handlers(worker: PrefillWorker) -> dict[str, Handler]:
    async def pair(p: dict[str, Any]) -> Any:
        return (await worker.pair(PairingInfo.from_dict(p["info"]))).to_dict()

    async def prefill(p: dict[str, Any]) -> Any:
        reader = p.get("reader")
        result = await worker.prefill(request_from_dict(p["request"]),
                                      None if reader is None else str(reader))
        return result.to_dict()

    async def release(p: dict[str, Any]) -> Any:
        return await worker.release(str(p["lease_id"]), str(p["reader"]))

    async def reject(p: dict[str, Any]) -> Any:
        return await worker.reject(str(p["lease_id"]), str(p.get("reason", "unspecified")))

    async def expire_leases(p: dict[str, Any]) -> Any:
        return await worker.expire_leases()

    async def status(p: dict[str, Any]) -> Any:
        return await worker.status()

    return {"pair": pair, "prefill": prefill, "release": release, "reject": reject,
            "expire_leases": expire_leases, "status": status}


class RemotePrefill:
    """A prefill worker in another process; usable wherever a PrefillWorker is (a PrefillPeer
    for decode workers, ``prefill`` for the gateway). ``key``, ``name``: the cluster secret
    this client proves, under its worker id (services/protocol/handoff.py)."""

    def __init__(self, host: str, port: int, key: ClusterKey | None = None,
                 name: str = "gateway") -> None:
        self.rpc = RpcClient(host, port, ERRORS, key=key, name=name)

    async def pair(self, info: PairingInfo) -> PairingInfo:
        return PairingInfo.from_dict(await self.rpc.call("pair", {"info": info.to_dict()}))

    async def prefill(self, request: GenerationRequest, reader: str | None = None
                      ) -> PrefillResult:
        result = await self.rpc.call("prefill", {"request": request_to_dict(request),
                                                 "reader": reader})
        return PrefillResult.from_dict(result)

    async def release(self, lease_id: str, reader: str) -> bool:
        return bool(await self.rpc.call("release", {"lease_id": lease_id, "reader": reader}))

    async def reject(self, lease_id: str, reason: str) -> bool:
        return bool(await self.rpc.call("reject", {"lease_id": lease_id, "reason": reason}))

    async def expire_leases(self) -> int:
        return int(await self.rpc.call("expire_leases"))

    async def status(self) -> dict[str, Any]:
        return dict(await self.rpc.call("status"))

    async def close(self) -> None:
        await self.rpc.close()


def build(engine: LLMEngine, transport: KVTransport, spec: WorkerSpec, area: TransferArea
          ) -> PrefillWorker:
    return PrefillWorker(engine, transport, PrefillConfig(**spec.role), spec.worker_id, area=area)


if __name__ == "__main__":
    USAGE = "python -m tandem.loadtest.rpc_workers.prefill '<WorkerSpec JSON>'"
    sys.exit(worker_main(None, USAGE, build, prefill_handlers))
