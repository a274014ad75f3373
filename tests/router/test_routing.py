"""Routing decisions against a real redis-server: affinity, load, decode choice, replicas."""

from __future__ import annotations

import collections
import logging

import pytest

from tandem.router import (
    InProcessEventBus,
    InProcessRegistry,
    NoHealthyWorkers,
    RedisRegistry,
    RedisStreamEventBus,
    RegistrationRefused,
    Router,
    RouterConfig,
    SettingsMismatch,
    WorkerLoad,
)
from tandem.services.protocol.block_hash import HashSettings

from .cluster import SETTINGS, FakeClock, WorkerHarness, make_info, start_worker, tokens
from .conftest import RedisServer, wait_until


class Cluster:
    """Routers and workers sharing one redis-server, all on one fake clock."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.clock = FakeClock()
        self.client = server.client()
        self.registry = RedisRegistry(self.client, ttl_s=30.0, clock=self.clock)
        self.bus = RedisStreamEventBus(self.client)
        self.routers: list[Router] = []

    def router(self, **options: object) -> Router:
        config = RouterConfig(SETTINGS, **options)  # type: ignore[arg-type]
        router = Router(config, RedisRegistry(self.server.client(), clock=self.clock),
                        RedisStreamEventBus(self.server.client()), clock=self.clock)
        self.routers.append(router)
        return router

    def worker(self, worker_id: str, role: str = "prefill",
               load: WorkerLoad | None = None) -> WorkerHarness:
        return start_worker(self.registry, self.bus, worker_id, role, load)

    def close(self) -> None:
        for router in self.routers:
            router.close()


@pytest.fixture
def cluster(redis_server: RedisServer) -> collections.abc.Iterator[Cluster]:
    c = Cluster(redis_server)
    yield c
    c.close()


def blocks(n: int, seed: int) -> list[int]:
    return tokens(seed, 16 * n)


@pytest.mark.parametrize("k", range(4))
def test_longest_cached_prefix_wins(cluster: Cluster, k: int) -> None:
    router = cluster.router()
    workers = [cluster.worker(f"p{i}") for i in range(4)]
    prompt = blocks(48, seed=1) + tokens(2, 20)
    lengths = [8, 16, 24, 32]
    lengths[k] = 40
    for worker, n in zip(workers, lengths, strict=True):
        worker.cache(prompt[: 16 * n])
    router.sync()

    decision = router.route(prompt)

    assert decision.prefill_worker == f"p{k}"
    assert decision.reason == "prefix"
    assert decision.cached_blocks == 40
    assert decision.prompt_blocks == 50
    assert decision.prefill_address == f"p{k}.test:7000"
    assert min(decision.prefill_scores, key=decision.prefill_scores.__getitem__) == f"p{k}"


def test_evicted_blocks_stop_attracting(cluster: Cluster) -> None:
    router = cluster.router()
    a, b = cluster.worker("a"), cluster.worker("b")
    prompt = blocks(20, seed=3)
    hashes = a.cache(prompt)
    b.cache(prompt[: 16 * 10])
    router.sync()
    assert router.route(prompt).prefill_worker == "a"
    a.evict(hashes[5:])
    router.sync()
    router.release("x")
    decision = router.route(prompt + tokens(4, 16))
    assert (decision.prefill_worker, decision.cached_blocks) == ("b", 10)


def test_hot_prefix_spreads_once_load_outweighs_the_miss(cluster: Cluster) -> None:
    router = cluster.router()
    hot = cluster.worker("p0")
    others = [cluster.worker(f"p{i}") for i in range(1, 4)]
    system = blocks(64, seed=5)
    hot.cache(system)
    router.sync()
    # prompt = 64 cached blocks + 2 more: cost(p0) = 2 + load, cost(other) = 66 + its load.
    chosen = {}
    for seed, pending in enumerate([0, 30, 63, 65, 200]):
        hot.heartbeat(WorkerLoad(pending_prefill_blocks=pending))
        for worker in others:
            worker.heartbeat(WorkerLoad())
        router.sync()
        decision = router.route(system + tokens(100 + seed, 32))
        router.release(decision.request_id)
        chosen[pending] = decision
    assert [chosen[p].prefill_worker for p in (0, 30, 63)] == ["p0"] * 3
    assert all(chosen[p].reason == "prefix" for p in (0, 30, 63))
    assert chosen[65].prefill_worker != "p0"
    assert chosen[65].reason == "load"
    assert chosen[65].prefill_scores["p0"] == 67.0
    # The worker that took the overflow now holds the prefix (provisionally) and keeps it.
    assert chosen[200].prefill_worker == chosen[65].prefill_worker


def test_burst_on_one_prefix_spreads_between_heartbeats(cluster: Cluster) -> None:
    balanced = cluster.router()
    affinity_only = cluster.router(load_weight=0.0)
    workers = [cluster.worker(f"p{i}") for i in range(4)]
    system = blocks(64, seed=6)
    workers[0].cache(system)
    for router in (balanced, affinity_only):
        router.sync()

    spread: collections.Counter[str] = collections.Counter()
    piled: collections.Counter[str] = collections.Counter()
    for seed in range(200):  # no heartbeats: only the routers' own in-flight counts
        prompt = system + tokens(1000 + seed, 32)
        spread[balanced.route(prompt).prefill_worker or ""] += 1
        piled[affinity_only.route(prompt).prefill_worker or ""] += 1

    assert piled == {"p0": 200}  # the failure mode when load is ignored
    assert set(spread) == {"p0", "p1", "p2", "p3"}
    assert max(spread.values()) <= 2 * min(spread.values())


def test_load_only_scoring_throws_the_cache_away(cluster: Cluster) -> None:
    balanced = cluster.router()
    load_only = cluster.router(miss_weight=0.0)
    cached = cluster.worker("p0", load=WorkerLoad(pending_prefill_blocks=4))
    for i in range(1, 4):
        cluster.worker(f"p{i}")
    prompt = blocks(64, seed=7)
    cached.cache(prompt)
    balanced.sync()
    load_only.sync()
    assert load_only.route(prompt).prefill_worker != "p0"
    decision = balanced.route(prompt)
    assert (decision.prefill_worker, decision.reason) == ("p0", "prefix")


def test_unloaded_workers_share_a_burst_of_new_prompts(cluster: Cluster) -> None:
    router = cluster.router()
    workers = [cluster.worker(f"p{i}") for i in range(4)]
    workers[0].cache(blocks(4, seed=8))  # the index is not empty, no prompt below hits it
    router.sync()
    counts = collections.Counter(
        router.route(blocks(64, seed=900 + i)).prefill_worker for i in range(8)
    )
    assert counts == {"p0": 2, "p1": 2, "p2": 2, "p3": 2}


def test_two_router_replicas_agree(cluster: Cluster) -> None:
    first = cluster.router()
    workers = [cluster.worker(f"p{i}") for i in range(4)]
    prompts = []
    for t in range(12):
        system = blocks(20 + 3 * t, seed=200 + t)
        workers[t % 4].cache(system)
        if t % 3 == 0:
            workers[(t + 1) % 4].cache(system[: 16 * 10])
        prompts.append(system + tokens(300 + t, 24))
    prompts += [blocks(30, seed=400 + i) for i in range(12)]  # uncached: ties everywhere
    first.sync()
    second = cluster.router()  # a replica started later reads the stream from its start
    second.sync()
    assert second.status().index_blocks == first.status().index_blocks > 0

    for prompt in prompts:
        a, b = first.route(prompt), second.route(prompt)
        assert (a.prefill_worker, a.reason, a.cached_blocks) == (
            b.prefill_worker, b.reason, b.cached_blocks)
        first.release(a.request_id)
        second.release(b.request_id)


def test_decode_choice_avoids_loaded_workers(cluster: Cluster) -> None:
    router = cluster.router()
    cluster.worker("p0")
    usages = {"d0": 0.1, "d1": 0.2, "d2": 0.3, "d3": 0.95}
    for worker_id, usage in usages.items():
        cluster.worker(worker_id, "decode", WorkerLoad(kv_usage=usage, running_sequences=4))
    router.sync()
    counts = collections.Counter()
    for i in range(60):
        decision = router.route(blocks(8, seed=500 + i))
        router.release(decision.request_id)
        counts[decision.decode_worker] += 1
        assert decision.decode_scores["d3"] > decision.decode_scores["d0"]
    assert "d3" not in counts
    assert counts["d0"] > counts["d2"]


def test_skip_prefill_for_short_prompts_and_prompts_cached_on_decode(cluster: Cluster) -> None:
    router = cluster.router(short_prompt_tokens=64)
    cluster.worker("p0")
    cluster.worker("d0", "decode")
    holder = cluster.worker("d1", "decode", WorkerLoad(kv_usage=0.5))
    prompt = blocks(30, seed=9)
    holder.cache(prompt)
    router.sync()

    short = router.route(tokens(10, 40))
    assert (short.prefill_worker, short.reason, short.detail) == (
        None, "skip_prefill", "short_prompt")
    assert short.skip_prefill and short.decode_worker in {"d0", "d1"}

    cached = router.route(prompt + tokens(11, 5))
    assert (cached.prefill_worker, cached.decode_worker, cached.detail) == (
        None, "d1", "cached_on_decode")
    assert cached.cached_blocks == 30

    partly = router.route(prompt + tokens(12, 40))  # two more full blocks: not fully cached
    assert partly.prefill_worker == "p0"


def test_without_prefill_workers_decode_computes_the_prompt(cluster: Cluster) -> None:
    router = cluster.router()
    router.sync()
    with pytest.raises(NoHealthyWorkers):
        router.route(blocks(4, seed=10))
    cluster.worker("d0", "decode")
    router.sync()
    decision = router.route(blocks(4, seed=10))
    assert (decision.prefill_worker, decision.decode_worker, decision.detail) == (
        None, "d0", "no_prefill_workers")


def test_worker_with_another_block_size_is_refused(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    # Registered before any router published the cluster settings: only the router can refuse.
    early = RedisRegistry(cluster.client)
    early.register(make_info("p-bs32", settings=HashSettings(32, SETTINGS.model_id)))
    router = cluster.router()
    cluster.worker("p0")
    late = make_info("p-late", settings=HashSettings(32, SETTINGS.model_id))
    with caplog.at_level(logging.ERROR):
        router.sync()
        # Once a router has published the cluster's settings, registration itself refuses.
        with pytest.raises(RegistrationRefused, match="block size 32 != 16"):
            cluster.registry.register(late)
    assert router.status().refused == {"p-bs32": "block size 32 != 16"}
    assert "refusing worker p-bs32: block size 32 != 16" in caplog.text
    assert "refusing worker p-late: block size 32 != 16" in caplog.text
    for i in range(20):
        assert router.route(blocks(6, seed=600 + i)).prefill_worker == "p0"
    with pytest.raises(RegistrationRefused, match="model"):
        cluster.registry.register(make_info("p-m", settings=HashSettings(16, "other-model")))


def test_router_with_other_settings_refuses_to_start(cluster: Cluster) -> None:
    cluster.router()
    with pytest.raises(SettingsMismatch):
        Router(RouterConfig(HashSettings(32, SETTINGS.model_id)), cluster.registry, cluster.bus)


def test_lapsed_heartbeat_gets_no_new_requests(cluster: Cluster) -> None:
    router = cluster.router()
    live = cluster.worker("p-live")
    short_lived = RedisRegistry(cluster.client, ttl_s=1.0, clock=cluster.clock)
    lapsing = start_worker(short_lived, cluster.bus, "p-lapsing")
    prompt = blocks(32, seed=11)
    lapsing.cache(prompt)
    live.cache(blocks(4, seed=12))
    assert lapsing.heartbeat()  # fresh 1 s TTL, started just before the router looks
    router.sync()
    first = router.route(prompt)
    assert first.prefill_worker == "p-lapsing"
    router.release(first.request_id)

    def lapsed() -> bool:  # Redis expires the record; the router notices on its next sync
        router.sync()
        return "p-lapsing" not in router.workers()

    wait_until(lapsed, timeout_s=10, what="the heartbeat to lapse")
    for i in range(30):
        decision = router.route(prompt + tokens(700 + i, 16))
        assert decision.prefill_worker == "p-live"

    assert lapsing.heartbeat()  # it comes back, its cache still indexed
    router.sync()
    assert "p-lapsing" in router.workers()
    assert router.cached_prefix(prompt)["p-lapsing"] == 32


def test_in_process_cluster_with_driven_clock() -> None:
    clock = FakeClock()
    registry = InProcessRegistry(SETTINGS, ttl_s=5.0, clock=clock)
    bus = InProcessEventBus()
    router = Router(RouterConfig(SETTINGS, forget_lapsed_after_s=60.0), registry, bus,
                    clock=clock)
    workers = [start_worker(registry, bus, f"p{i}") for i in range(3)]
    prompt = blocks(24, seed=13)
    workers[2].cache(prompt)
    router.sync()
    assert router.route(prompt).prefill_worker == "p2"

    clock.advance(4.0)
    for worker in workers[:2]:
        worker.heartbeat()
    clock.advance(2.0)  # p2's last heartbeat is now 6 s old, past the 5 s TTL
    router.sync()
    assert set(router.workers()) == {"p0", "p1"}
    assert router.route(prompt).prefill_worker in {"p0", "p1"}

    clock.advance(61.0)  # long gone: its index entries are dropped
    for worker in workers[:2]:
        worker.heartbeat()
    router.sync()
    assert "p2" not in router.status().indexed_workers
    workers[2].heartbeat()  # back: the router asks for snapshots and the forwarder resends
    router.sync()
    workers[2].heartbeat()
    router.sync()
    decision = router.route(prompt)
    assert (decision.prefill_worker, decision.reason) == ("p2", "prefix")


def test_background_sync_thread(cluster: Cluster) -> None:
    router = cluster.router()
    router.start(poll_s=0.02, registry_every_s=0.02, retry_s=0.05)
    workers = [cluster.worker(f"p{i}") for i in range(3)]
    prompt = blocks(16, seed=14)
    workers[1].cache(prompt)
    wait_until(lambda: router.cached_prefix(prompt).get("p1") == 16, what="the index to fill")
    assert router.route(prompt).prefill_worker == "p1"
    router.close()


def test_one_request_at_a_time_keeps_its_prefix_worker(cluster: Cluster) -> None:
    """A heartbeat sampled while a request was in flight must not count it once released."""
    router = cluster.router()
    holder, idle = cluster.worker("p0"), cluster.worker("p1")
    system = blocks(12, seed=9)
    holder.cache(system)
    router.sync()
    for seed in range(5):
        # 12 cached + 14 new blocks: cost(p0) = 14, cost(p1) = 26 with no load.
        decision = router.route(system + tokens(200 + seed, 14 * 16))
        assert decision.prefill_worker == "p0" and decision.reason == "prefix"
        cluster.clock.advance(0.1)
        # p0 reports while it computes this request's 14 blocks (a stale 14 would flip it).
        holder.heartbeat(WorkerLoad(pending_prefill_blocks=14))
        idle.heartbeat(WorkerLoad())
        router.sync()
        router.release(decision.request_id)  # the prefill finished; no heartbeat since
        cluster.clock.advance(0.1)
    # A later heartbeat that really shows load is still respected.
    holder.heartbeat(WorkerLoad(pending_prefill_blocks=40))
    router.sync()
    assert router.route(system + tokens(300, 14 * 16)).prefill_worker == "p1"
