"""The prefill worker on the control channel: server handlers and the client (RemotePrefill)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.services.control.codec import params_from_dict, params_to_dict, token_ids
from tandem.services.control.rpc import Handler, RpcClient
from tandem.services.kv_transfer.pairing import PairingError, PairingInfo
from tandem.services.prefill.worker import PrefillWorker
from tandem.services.protocol.auth import ClusterKey
from tandem.services.protocol.handoff import PrefillResult
from tandem.services.protocol.outputs import EngineOverloadedError, RequestError
from tandem.services.protocol.sampling_params import SamplingParams

ERRORS: dict[str, type[Exception]] = {
    "PairingError": PairingError, "RequestError": RequestError,
    "EngineOverloadedError": EngineOverloadedError,
}


def prefill_handlers(worker: PrefillWorker) -> dict[str, Handler]:
    async def pair(p: dict[str, Any]) -> Any:
        return (await worker.pair(PairingInfo.from_dict(p["info"]))).to_dict()

    async def prefill(p: dict[str, Any]) -> Any:
        salt, reader = p.get("cache_salt"), p.get("reader")
        result = await worker.prefill(str(p["request_id"]), token_ids(p["prompt"]),
                                      params_from_dict(p["params"]),
                                      None if salt is None else str(salt),
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
    this client proves, under its worker id (services/protocol/auth.py)."""

    def __init__(self, host: str, port: int, key: ClusterKey | None = None,
                 name: str = "gateway") -> None:
        self.rpc = RpcClient(host, port, ERRORS, key=key, name=name)

    async def pair(self, info: PairingInfo) -> PairingInfo:
        return PairingInfo.from_dict(await self.rpc.call("pair", {"info": info.to_dict()}))

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, cache_salt: str | None = None,
                      reader: str | None = None) -> PrefillResult:
        result = await self.rpc.call("prefill", {
            "request_id": request_id, "prompt": list(prompt_token_ids),
            "params": params_to_dict(params), "cache_salt": cache_salt, "reader": reader})
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
