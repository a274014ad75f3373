"""Redis dies mid-run: routing goes on by rendezvous hashing, then the index rebuilds."""

from __future__ import annotations

import collections

from tandem.router import (
    InProcessEventBus,
    InProcessRegistry,
    RedisRegistry,
    RedisStreamEventBus,
    Router,
    RouterConfig,
    WorkerLoad,
)
from tandem.router.router import rendezvous_choose, rendezvous_key

from .cluster import SETTINGS, FakeClock, start_worker, tokens
from .conftest import RedisServer, wait_until


def test_redis_restart_falls_back_then_rebuilds(redis_server: RedisServer) -> None:
    clock = FakeClock()
    client = redis_server.client()
    registry = RedisRegistry(client, ttl_s=30.0, clock=clock)
    bus = RedisStreamEventBus(client)
    router = Router(RouterConfig(SETTINGS), RedisRegistry(redis_server.client(), clock=clock),
                    RedisStreamEventBus(redis_server.client()), clock=clock)
    workers = [start_worker(registry, bus, f"p{i}") for i in range(4)]
    systems = [tokens(10 + t, 16 * 40) for t in range(8)]
    for t, system in enumerate(systems):
        workers[t % 4].cache(system)
    router.sync()
    assert router.route(systems[1] + tokens(99, 8)).reason == "prefix"

    redis_server.kill()
    router.sync()  # notices the outage; must not raise
    status = router.status()
    assert not status.bus_connected and not status.registry_connected
    assert status.workers == {"p0", "p1", "p2", "p3"}  # the last known snapshot

    # While Redis is down the workers keep caching; their events cannot be delivered.
    late = tokens(50, 16 * 40)
    workers[3].cache(late)
    assert not workers[3].forwarder.in_sync
    assert not workers[3].heartbeat(WorkerLoad())

    reasons: collections.Counter[str] = collections.Counter()
    for i in range(300):
        prompt = systems[i % 8] + tokens(1000 + i, 24)
        decision = router.route(prompt)  # a failed decision would raise
        assert decision.prefill_worker in {"p0", "p1", "p2", "p3"}
        hashes = router.hasher.hashes(prompt)
        assert decision.prefill_worker == rendezvous_choose(
            rendezvous_key(hashes, 4), ["p0", "p1", "p2", "p3"])
        reasons[decision.reason] += 1
        router.release(decision.request_id)
        if i % 50 == 0:
            router.sync()  # retries keep failing quietly
    assert reasons == {"fallback": 300}

    redis_server.start()  # same port, empty: stream, groups and registry are gone

    def rebuilt() -> bool:
        for worker in workers:
            worker.heartbeat(WorkerLoad())  # re-registers and resends a cache snapshot
        router.sync()
        status = router.status()
        return (status.bus_connected and not status.rebuilding
                and status.indexed_workers == {"p0", "p1", "p2", "p3"})

    wait_until(rebuilt, timeout_s=15, what="the index to rebuild")
    assert router.status().rebuilds >= 2  # the first connection, then the reconnection
    for t, system in enumerate(systems):
        decision = router.route(system + tokens(2000 + t, 8))
        assert (decision.prefill_worker, decision.reason) == (f"p{t % 4}", "prefix")
        router.release(decision.request_id)
    # Blocks cached during the outage reached the index through the snapshot.
    decision = router.route(late)
    assert (decision.prefill_worker, decision.cached_blocks) == ("p3", 40)


def test_router_started_while_redis_is_down(redis_server: RedisServer) -> None:
    redis_server.kill()
    router = Router(RouterConfig(SETTINGS), RedisRegistry(redis_server.client()),
                    RedisStreamEventBus(redis_server.client()))
    router.sync()
    assert not router.status().registry_connected
    redis_server.start()
    client = redis_server.client()
    worker = start_worker(RedisRegistry(client), RedisStreamEventBus(client), "p0")
    prompt = tokens(7, 16 * 8)
    worker.cache(prompt)

    def ready() -> bool:
        router.sync()
        return router.cached_prefix(prompt).get("p0") == 8

    wait_until(ready, what="the router to connect")
    assert router.route(prompt).reason == "prefix"
    router.close()


def test_mark_down_routes_around_a_gone_worker_until_it_heartbeats() -> None:
    clock = FakeClock()
    registry = InProcessRegistry(SETTINGS, ttl_s=30.0, clock=clock)
    bus = InProcessEventBus()
    router = Router(RouterConfig(SETTINGS), registry, bus, clock=clock)
    workers = [start_worker(registry, bus, f"p{i}") for i in range(2)]
    prompt = tokens(7, 16 * 20)
    workers[0].cache(prompt)
    router.sync()
    assert router.route(prompt).prefill_worker == "p0"

    router.mark_down("p0", "replica_gone")  # a call found p0's replica gone
    assert router.status().failovers == {("prefill", "replica_gone"): 1}
    for _ in range(3):
        router.sync()  # p0's registry record is still fresh, but it has not heartbeated since
        assert router.route(prompt).prefill_worker == "p1"
    workers[0].heartbeat()
    router.sync()
    assert router.route(prompt).prefill_worker == "p0"


def test_redis_error_replies_mark_the_forwarder_for_resync(redis_server: RedisServer) -> None:
    """OOM under noeviction is an error reply, not a dropped connection: the worker's publisher
    must not die on it; it drops the batch and resyncs once Redis accepts writes again."""
    registry = RedisRegistry(redis_server.client())
    worker = start_worker(registry, RedisStreamEventBus(redis_server.client()), "p0")
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    worker.cache(tokens(3, 16 * 8))  # publishing fails with an OOM reply: no exception here
    assert not worker.forwarder.in_sync
    admin.config_set("maxmemory", "0")
    assert worker.forwarder.resync()
    router = Router(RouterConfig(SETTINGS), RedisRegistry(redis_server.client()),
                    RedisStreamEventBus(redis_server.client()))
    router.sync()
    assert router.cached_prefix(tokens(3, 16 * 8))["p0"] == 8
