"""Redis is soft state: paused (SIGSTOP), read-only (made a replica), full (OOM under
noeviction) or not started yet, it never raises into workers or the router, never blocks the
engine thread or ``route()``, and once it is back the index catches up by itself."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import redis

from tandem.router import (
    FallbackRegistry,
    InProcessRegistry,
    RedisRegistry,
    RedisStreamEventBus,
    Router,
    RouterConfig,
    WorkerLoad,
    connect,
)
from tandem.services.protocol.block_hash import hash_token_blocks
from tandem.services.protocol.kv_events import BlockStored
from tandem.services.serving.workers import WorkerEvents

from .cluster import SETTINGS, make_info, start_worker, tokens
from .conftest import RedisServer, free_port, wait_until

T = TypeVar("T")

# A failing command costs at most two 0.5 s socket timeouts (one retry); a few of them in a row
# fit well inside this. Anything near it would mean a caller waits on Redis.
FAILING_CALL_S = 5.0
# Shorter than one socket timeout (0.5 s), which is the least a caller blocked on a paused Redis
# waits; scheduling and GC pauses on a busy machine stay below it.
NEVER_WAITS_S = 0.4


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``, which must return (not raise, not hang) within ``seconds``."""
    started = time.monotonic()
    result = call()
    elapsed = time.monotonic() - started
    assert elapsed < seconds, f"took {elapsed:.2f}s"
    return result


@contextlib.contextmanager
def redis_fault(server: RedisServer, kind: str) -> Iterator[None]:
    """Redis paused (SIGSTOP), read-only (a replica of a master that is not there) or full
    (``maxmemory 1mb`` under ``noeviction``, filled beyond it) for the ``with`` block."""
    admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    try:
        if kind == "paused":
            server.pause()
        elif kind == "readonly":
            admin.replicaof("127.0.0.1", str(free_port()))
            with pytest.raises(redis.ReadOnlyError):
                admin.set("probe", 1)
        else:
            admin.set("filler", b"x" * 2_000_000)
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", "1mb")
            with pytest.raises(redis.OutOfMemoryError):
                admin.set("probe", 1)
        yield
    finally:
        if kind == "paused":
            server.resume()
        elif kind == "readonly":
            admin.replicaof("NO", "ONE")
        else:
            admin.config_set("maxmemory", "0")
            admin.delete("filler")
        admin.close()


def stored(prompt: list[int]) -> BlockStored:
    """The event a block manager emits once it caches the prompt's full blocks."""
    hashes = hash_token_blocks(prompt, SETTINGS.block_size, SETTINGS.extra_keys(None))
    return BlockStored(tuple(hashes), None, SETTINGS.block_size)


def redis_router(url: str, local: InProcessRegistry) -> Router:
    """The gateway's router in Redis mode: Redis, with the polled workers as the fallback."""
    return Router(RouterConfig(SETTINGS), FallbackRegistry(RedisRegistry(connect(url)), local),
                  RedisStreamEventBus(connect(url)))


@pytest.mark.parametrize("kind", ["paused", "readonly", "oom"])
def test_workers_and_router_ride_out_a_fault(redis_server: RedisServer, kind: str) -> None:
    local = InProcessRegistry(SETTINGS, ttl_s=60.0)  # what the gateway's status polls register
    router = redis_router(redis_server.url, local)
    workers = [start_worker(RedisRegistry(redis_server.client(), ttl_s=1.0),
                            RedisStreamEventBus(redis_server.client()), f"p{i}")
               for i in range(2)]
    for worker in workers:
        local.register(worker.info)
    before, during = tokens(1, 16 * 8), tokens(2, 16 * 8)
    workers[0].cache(before)
    router.sync()
    decision = router.route(before)
    assert (decision.prefill_worker, decision.reason) == ("p0", "prefix")

    with redis_fault(redis_server, kind):
        for worker in workers:
            assert not within(FAILING_CALL_S, worker.heartbeat)
        within(FAILING_CALL_S, lambda: workers[1].cache(during))  # the publish fails quietly
        assert not workers[1].forwarder.in_sync
        if kind != "paused":  # heartbeats fail, so the records lapse in Redis
            listing = RedisRegistry(redis_server.client())
            wait_until(lambda: listing.workers() == [], what="the records to lapse")
        within(FAILING_CALL_S, router.sync)
        assert set(router.workers()) == {"p0", "p1"}  # from the fallback registry
        decision = router.route(before)
        if kind == "oom":  # reads still work: the index stays, only new events are missing
            assert router.status().bus_connected
            assert (decision.prefill_worker, decision.reason) == ("p0", "prefix")
        else:
            assert not router.status().bus_connected
            assert decision.reason == "fallback"

    def caught_up() -> bool:
        for worker in workers:
            worker.heartbeat()  # registers again and republishes the cache
        router.sync()
        status = router.status()
        return (status.bus_connected and not status.rebuilding
                and router.cached_prefix(during).get("p1") == 8)

    wait_until(caught_up, timeout_s=20, what="the index to catch up")
    for prompt, holder in ((before, "p0"), (during, "p1")):
        decision = router.route(prompt)
        assert (decision.prefill_worker, decision.reason) == (holder, "prefix")
    registered = {r.worker_id for r in RedisRegistry(redis_server.client()).workers()}
    assert registered == {"p0", "p1"}
    router.close()


def test_fallback_registry_prefers_redis_and_completes_it(redis_server: RedisServer) -> None:
    primary = RedisRegistry(redis_server.client())
    local = InProcessRegistry(SETTINGS)
    registry = FallbackRegistry(primary, local)
    registry.publish_settings(SETTINGS)
    primary.register(make_info("p0"), WorkerLoad(pending_prefill_blocks=7))
    local.register(make_info("p0"))
    local.register(make_info("p1"))
    loads = {r.worker_id: r.load.pending_prefill_blocks for r in registry.workers()}
    assert loads == {"p0": 7, "p1": 0}  # Redis' record wins; the local one fills the gap

    redis_server.kill()
    assert {r.worker_id for r in registry.workers()} == {"p0", "p1"}
    assert not registry.primary_available
    assert registry.cluster_settings() == SETTINGS

    redis_server.start()  # empty: no workers, no settings
    assert {r.worker_id for r in registry.workers()} == {"p0", "p1"}
    assert registry.primary_available
    assert primary.cluster_settings() == SETTINGS  # published again after the outage


def test_route_never_waits_on_a_paused_redis(redis_server: RedisServer) -> None:
    """A sync round stuck on a paused Redis (reading events, asking for snapshots because a
    forgotten worker came back) holds no lock that ``route()`` needs."""
    local = InProcessRegistry(SETTINGS)
    router = Router(RouterConfig(SETTINGS, forget_lapsed_after_s=0.0), local,
                    RedisStreamEventBus(redis_server.client()))
    local.register(make_info("p0"))
    local.register(make_info("p1"))
    router.sync()
    local.deregister("p1")
    router.sync()  # p1 lapsed and is forgotten at once
    local.register(make_info("p1"))  # back: the next sync asks for snapshots
    redis_server.pause()
    syncing = threading.Thread(target=router.sync, daemon=True)
    syncing.start()
    slowest = 0.0
    prompt = tokens(3, 16 * 8)
    while syncing.is_alive():  # about two seconds: reading events, then asking for snapshots
        started = time.monotonic()
        router.release(router.route(prompt).request_id)
        slowest = max(slowest, time.monotonic() - started)
    syncing.join()
    redis_server.resume()
    assert set(router.workers()) == {"p0", "p1"}
    assert slowest < NEVER_WAITS_S, f"route() waited {slowest:.2f}s"


def test_engine_thread_never_waits_on_a_paused_redis(redis_server: RedisServer) -> None:
    events = WorkerEvents("p0", redis_server.url, heartbeat_s=0.2)
    events.start(make_info("p0"), WorkerLoad)
    router = redis_router(redis_server.url, InProcessRegistry(SETTINGS))
    prompts = [tokens(10 + i, 16 * 4) for i in range(20)]
    batches = [[stored(p)] for p in prompts]
    try:
        wait_until(lambda: events.forwarder.in_sync, what="the worker to join")
        redis_server.pause()
        slowest, calls = 0.0, 0
        # Until the publisher thread, stuck on the paused Redis, gives up on its batch.
        deadline = time.monotonic() + 10 * FAILING_CALL_S
        while events.forwarder.in_sync and time.monotonic() < deadline:
            started = time.monotonic()
            events.on_engine_events(batches[calls % len(batches)])
            slowest = max(slowest, time.monotonic() - started)
            calls += 1
            time.sleep(0.002)  # an engine step's pace, not synchronisation
        assert not events.forwarder.in_sync
        redis_server.resume()
        assert slowest < NEVER_WAITS_S, f"the engine thread waited {slowest:.2f}s"

        def indexed() -> bool:
            router.sync()
            return all(router.cached_prefix(p).get("p0") == 4 for p in prompts[:calls])

        wait_until(indexed, timeout_s=20, what="every block in the index")
    finally:
        redis_server.resume()
        asyncio.run(events.close())
        router.close()


def test_worker_and_router_start_while_redis_is_down(redis_later: RedisServer) -> None:
    """Nothing listens on the Redis port yet: the worker starts and the router routes by
    rendezvous over the polled workers; once Redis is started the index is built and routing
    is prefix-aware."""
    local = InProcessRegistry(SETTINGS, ttl_s=60.0)  # the gateway's polls keep it fresh
    router = within(FAILING_CALL_S, lambda: redis_router(redis_later.url, local))
    events = WorkerEvents("p0", redis_later.url, heartbeat_s=0.2)
    info = make_info("p0")
    within(0.5, lambda: events.start(info, WorkerLoad))
    local.register(info)  # the gateway's status poll
    prompt = tokens(5, 16 * 8)
    events.on_engine_events([stored(prompt)])
    try:
        router.sync()
        router.start()
        decision = router.route(prompt)
        assert (decision.prefill_worker, decision.reason) == ("p0", "fallback")

        redis_later.start()
        wait_until(lambda: router.cached_prefix(prompt).get("p0") == 8
                   and not router.status().rebuilding, timeout_s=20,
                   what="the router to connect and index the worker's cache")
        assert router.status().bus_connected
        decision = router.route(prompt)
        assert (decision.prefill_worker, decision.reason) == ("p0", "prefix")
        registered = [r.worker_id for r in RedisRegistry(redis_later.client()).workers()]
        assert registered == ["p0"]
    finally:
        asyncio.run(events.close())
        router.close()
