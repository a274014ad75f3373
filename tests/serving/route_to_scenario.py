"""The route-to scenario on a real Ray Serve application, run as its own process by
tests/serving/test_route_to.py (so Ray's processes belong to it, not to pytest, and all of them
stop with it). Prints one JSON line of observations; the test asserts on them."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from tandem.loadtest.ports import free_port
from tandem.router import InProcessEventBus, InProcessRegistry, Router, RouterConfig, WorkerInfo
from tandem.router.wire import WorkerEvent
from tandem.services.protocol.block_hash import HashSettings, hash_token_blocks
from tandem.services.protocol.kv_events import AllBlocksCleared, BlockStored
from tandem.services.protocol.messages import ReplicaGoneError
from tandem.services.protocol.outputs import RequestOutput
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tandem.services.serving.backend import DisaggBackend
from tandem.services.serving.cluster_view import ClusterView
from tandem.services.serving.config import AppConfig
from tandem.services.serving.decode_channel import call

APP = "route-to-test"
PROMPT = [1000 + i for i in range(40)]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
GONE = "gone-prefill-replica"


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, PARAMS)


async def _refused(response: Any) -> str | None:
    """The ReplicaGoneError message a call was refused with; None if it was served."""
    try:
        await call(response)
    except ReplicaGoneError as exc:
        return str(exc)
    return None


async def named_calls(handles: dict[str, Any]) -> dict[str, Any]:
    prefill = handles["prefill"]
    worker = str((await prefill.status.remote())["worker_id"])
    named = await prefill.status.remote(route_to=worker)
    out = {
        "worker": worker,
        "named_status_from": named["worker_id"],
        "gone_status": await prefill.status.remote(route_to="no-such-replica"),
        "gone_prefill": await _refused(prefill.prefill.remote(_request("gone-1"),
                                                              route_to="no-such-replica")),
        "gone_reject": await _refused(prefill.reject.remote("lease", "test",
                                                            route_to="no-such-replica")),
    }
    after = await prefill.status.remote(route_to=worker)
    out["leases_after"] = after["leases"]
    out["running_after"] = after["engine"]["num_running"]
    return out


async def failover(handles: dict[str, Any]) -> dict[str, Any]:
    settings = HashSettings(16, "SmolLM2-135M-Instruct")
    registry, bus = InProcessRegistry(settings, ttl_s=600.0), InProcessEventBus()
    # Every request prefilled on P (none on D, even once D's cache events for the prompt have
    # arrived: how soon they do depends on the machine's load), as the failover it follows
    # needs.
    router = Router(RouterConfig(settings, provisional_ttl_s=0.0, max_local_prefill_tokens=0,
                                 skip_prefill_when_cached_on_decode=False), registry, bus)
    view = ClusterView(router, handles, registry, bus, poll_s=0.5)
    await view.wait_for({"prefill": 1, "decode": 1}, timeout_s=300.0)
    live = next(w.worker_id for w in view.workers.values() if w.role == "prefill")
    # A replica that was chosen for this prompt's prefix, then went away.
    registry.register(WorkerInfo(GONE, "prefill", "127.0.0.1", 16, settings.model_id, 256))
    hashes = tuple(hash_token_blocks(PROMPT, 16, settings.extra_keys(None)))
    bus.publish([WorkerEvent(GONE, AllBlocksCleared(), 1),
                 WorkerEvent(GONE, BlockStored(hashes, None, 16), 2)])
    router.sync()
    chosen_before = router.route(PROMPT).prefill_worker
    backend = DisaggBackend(router, view, handles["prefill"], handles["decode"],
                            settings.model_id, 2048)
    outputs = [out async for out in backend.generate(_request("failover-1"))]
    chosen_after = router.route(PROMPT).prefill_worker
    status = await handles["prefill"].status.remote(route_to=live)
    await view.close()
    return {
        "live": live, "chosen_before": chosen_before, "chosen_after": chosen_after,
        "tokens": [t for out in outputs for t in out.new_token_ids],
        "finished": outputs[-1].finished if outputs else False,
        "failovers": [[role, reason, n] for (role, reason), n
                      in router.status().failovers.items()],
        "leases_after": status["leases"],
    }


async def channel(handles: dict[str, Any]) -> dict[str, Any]:
    """A decode channel driven directly: a submit naming no channel is refused; two requests
    stream on one channel; one is aborted, then the channel is cancelled with the other still
    decoding: both aborted, every block free."""
    decode = handles["decode"]
    worker = str((await decode.status.remote())["worker_id"])
    out: dict[str, Any] = {"unknown": await _refused(decode.submit.remote(
        _request("no-channel"), "no-such-channel", route_to=worker))}
    stream = decode.options(stream=True).channel.remote("test-channel", route_to=worker)
    out["hello"] = [type(item).__name__ for item in await anext(stream)]
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for request_id in ("long-1", "long-2"):
        await decode.submit.remote(GenerationRequest(request_id, PROMPT, long), "test-channel",
                                   route_to=worker)
    tokens = {"long-1": 0, "long-2": 0}
    async for batch in stream:
        for item in batch:
            if isinstance(item, RequestOutput):
                tokens[item.request_id] += len(item.new_token_ids)
        if min(tokens.values()) >= 3:
            break
    out["running"] = (await decode.status.remote(route_to=worker))["engine"]["num_running"]
    await decode.abort.remote("test-channel", "long-1", route_to=worker)
    out["running_after_abort"] = (await decode.status.remote(route_to=worker)
                                  )["engine"]["num_running"]
    stream.cancel()
    engine: dict[str, Any] = {}
    for _ in range(600):  # the replica aborts the channel's requests when its stream ends
        engine = (await decode.status.remote(route_to=worker))["engine"]
        if engine["num_running"] == 0 and engine["num_free_blocks"] == engine["num_blocks"]:
            break
        await asyncio.sleep(0.1)
    out["running_after_cancel"] = engine["num_running"]
    out["free_after_cancel"] = engine["num_free_blocks"] == engine["num_blocks"]
    out["submit_after_cancel"] = await _refused(decode.submit.remote(
        _request("late"), "test-channel", route_to=worker))
    return out


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from tandem.services.app import build_app

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="WARNING",
             object_store_memory=128 * 1024 * 1024)
    try:
        port = free_port()
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        config = AppConfig(kv_transport="tcp", num_kv_blocks=256, port=port,
                           grpc_port=free_port())
        serve.run(build_app(config), name=APP, route_prefix=None, blocking=False)
        handles = {role: serve.get_deployment_handle(role, APP) for role in ("prefill", "decode")}
        result = {"named": asyncio.run(named_calls(handles)),
                  "failover": asyncio.run(failover(handles)),
                  "channel": asyncio.run(channel(handles))}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
