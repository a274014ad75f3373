"""The router's choice is final, on a real Ray Serve application (the built-in model, 1 prefill
and 1 decode replica): a call reaches the replica it names; a call naming a replica that is gone
is refused with ReplicaGoneError (never silently served elsewhere); the disaggregated backend
then fails over visibly (counted) and the request completes on a live worker."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from router import InProcessEventBus, InProcessRegistry, Router, RouterConfig, WorkerInfo
from router.wire import WorkerEvent
from services.engine.block_hash import HashSettings, hash_token_blocks
from services.engine.kv_events import AllBlocksCleared, BlockStored
from services.engine.sampling_params import SamplingParams
from services.request import GenerationRequest
from services.serving.backend import DisaggBackend, _call
from services.serving.cluster_view import ClusterView
from services.serving.config import AppConfig
from services.serving.messages import ReplicaGoneError

pytestmark = pytest.mark.timeout(600)

APP = "route-to-test"
PROMPT = [1000 + i for i in range(40)]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def handles() -> Iterator[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray import serve

        from services.app import build_app

        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, logging_level="WARNING",
                 object_store_memory=128 * 1024 * 1024)
        try:
            port = _free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port},
                        logging_config={"log_level": "WARNING"})
            config = AppConfig(kv_transport="tcp", num_kv_blocks=256, port=port,
                               grpc_port=_free_port())
            serve.run(build_app(config), name=APP, route_prefix=None, blocking=False)
            yield {role: serve.get_deployment_handle(role, APP)
                   for role in ("prefill", "decode")}
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, PARAMS)


async def _replica_id(handle: Any) -> str:
    status = await handle.status.remote()
    return str(status["worker_id"])


def test_a_call_reaches_the_replica_it_names_or_is_refused(handles: dict[str, Any]) -> None:
    async def check() -> None:
        prefill = handles["prefill"]
        worker = await _replica_id(prefill)
        status = await prefill.status.remote(route_to=worker)
        assert status is not None and status["worker_id"] == worker
        assert await prefill.status.remote(route_to="no-such-replica") is None
        with pytest.raises(ReplicaGoneError, match="no-such-replica is gone"):
            await _call(prefill.prefill.remote(_request("gone-1"), route_to="no-such-replica"))
        with pytest.raises(ReplicaGoneError):
            await _call(prefill.reject.remote("lease", "test", route_to="no-such-replica"))
        # Nothing was prefilled or pinned anywhere by the refused calls.
        status = await prefill.status.remote(route_to=worker)
        assert status["leases"] == 0 and status["engine"]["num_running"] == 0

    asyncio.run(check())


def test_backend_fails_over_from_a_gone_prefill_replica(handles: dict[str, Any]) -> None:
    async def check() -> None:
        settings = HashSettings(16, "SmolLM2-135M-Instruct")
        registry, bus = InProcessRegistry(settings, ttl_s=600.0), InProcessEventBus()
        router = Router(RouterConfig(settings, provisional_ttl_s=0.0), registry, bus)
        view = ClusterView(router, handles, registry, bus, poll_s=0.5)
        await view.wait_for({"prefill": 1, "decode": 1}, timeout_s=300.0)
        live = next(w for w in view.workers.values() if w.role == "prefill")
        # A replica that was chosen for this prompt's prefix, then went away.
        gone = "gone-prefill-replica"
        registry.register(WorkerInfo(gone, "prefill", "127.0.0.1", 16, settings.model_id, 256))
        hashes = tuple(hash_token_blocks(PROMPT, 16, settings.extra_keys(None)))
        bus.publish([WorkerEvent(gone, AllBlocksCleared(), 1),
                     WorkerEvent(gone, BlockStored(hashes, None, 16), 2)])
        router.sync()
        assert router.route(PROMPT).prefill_worker == gone

        backend = DisaggBackend(router, view, handles["prefill"], handles["decode"],
                                settings.model_id, 2048)
        outputs = [out async for out in backend.generate(_request("failover-1"))]
        tokens = [t for out in outputs for t in out.new_token_ids]
        assert len(tokens) == PARAMS.max_tokens and outputs[-1].finished
        assert router.status().failovers == {("prefill", "replica_gone"): 1}
        assert router.route(PROMPT).prefill_worker == live.worker_id  # routed around it
        # The failed-over request left no lease and no blocks behind.
        await view.poll_once()
        status = await handles["prefill"].status.remote(route_to=live.worker_id)
        assert status["leases"] == 0
        await view.close()

    asyncio.run(check())
