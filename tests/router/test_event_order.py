"""Numbered KV events: applied in order per worker (late ones wait for the missing ones); a
gap that lasts drops that worker's events until a snapshot, asks the workers for one, and the
snapshot repairs the index."""

from __future__ import annotations

from tandem.router import InProcessEventBus, InProcessRegistry, Router, RouterConfig, attach_worker
from tandem.router.wire import WorkerEvent
from tandem.services.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .cluster import SETTINGS, FakeClock, make_info, tokens

CLOCK = FakeClock()


def _router() -> tuple[Router, InProcessEventBus]:
    registry = InProcessRegistry(SETTINGS, ttl_s=1e9, clock=CLOCK)
    registry.register(make_info("p0"))
    registry.register(make_info("p1"))
    bus = InProcessEventBus()
    config = RouterConfig(SETTINGS, provisional_ttl_s=0.0)
    return Router(config, registry, bus, clock=CLOCK), bus


def test_events_out_of_order_wait_for_the_missing_ones() -> None:
    router, bus = _router()
    a = tokens(7, 16 * 4)
    ha = router.hasher.hashes(a)
    bus.publish([WorkerEvent("p0", AllBlocksCleared(), 1)])
    # Two reports cross: the later one (evict, then store again) arrives first.
    bus.publish([WorkerEvent("p0", BlockRemoved(tuple(ha)), 3),
                 WorkerEvent("p0", _stored(ha), 4)])
    router.sync()
    assert router.cached_prefix(a)["p0"] == 0  # waiting for event 2
    bus.publish([WorkerEvent("p0", _stored(ha), 2)])
    router.sync()
    assert router.cached_prefix(a)["p0"] == 4  # 2, 3, 4 applied in order: still held
    CLOCK.advance(10)
    router.sync()
    assert router.status().event_gaps == 0


def _stored(hashes: list[bytes]) -> BlockStored:
    return BlockStored(tuple(hashes), None, SETTINGS.block_size)


def test_gap_drops_events_until_snapshot_and_requests_one() -> None:
    router, bus = _router()
    a, b = tokens(1, 16 * 8), tokens(2, 16 * 8)
    ha, hb = router.hasher.hashes(a), router.hasher.hashes(b)
    bus.publish([WorkerEvent("p0", AllBlocksCleared(), 1), WorkerEvent("p0", _stored(ha), 2)])
    router.sync()
    assert router.cached_prefix(a)["p0"] == 8
    generation = bus.generation()  # (the router's first sync asked for snapshots once)

    # Event 3 is lost (say, a report the gateway never read); 4 arrives and waits for it.
    bus.publish([WorkerEvent("p0", _stored(hb), 4)])
    router.sync()
    assert router.status().event_gaps == 0 and bus.generation() == generation
    CLOCK.advance(2.5)
    router.sync()
    status = router.status()
    assert status.event_gaps == 1
    assert router.cached_prefix(b)["p0"] == 0  # not applied out of order
    assert bus.generation() != generation  # the workers are asked for snapshots
    # Until the snapshot, p0's events are dropped, even the late event 3.
    bus.publish([WorkerEvent("p0", BlockRemoved(tuple(ha)), 3)])
    router.sync()
    assert router.cached_prefix(a)["p0"] == 8

    # The snapshot (numbered after everything the worker sent) resets p0's entries.
    bus.publish([WorkerEvent("p0", AllBlocksCleared(), 5), WorkerEvent("p0", _stored(hb), 6)])
    router.sync()
    assert router.cached_prefix(a)["p0"] == 0
    assert router.cached_prefix(b)["p0"] == 8
    # Older numbers arriving after the snapshot are stale: dropped.
    bus.publish([WorkerEvent("p0", BlockRemoved(tuple(hb)), 4)])
    router.sync()
    assert router.cached_prefix(b)["p0"] == 8
    assert router.status().event_gaps == 1


def test_one_workers_gap_leaves_the_others_alone() -> None:
    router, bus = _router()
    a = tokens(3, 16 * 4)
    bus.publish([WorkerEvent("p1", AllBlocksCleared(), 1), WorkerEvent("p0", AllBlocksCleared(), 1),
                 WorkerEvent("p0", _stored(router.hasher.hashes(a)), 5),  # gap on p0
                 WorkerEvent("p1", _stored(router.hasher.hashes(a)), 2)])
    router.sync()
    CLOCK.advance(2.5)
    router.sync()
    assert router.status().event_gaps == 1
    assert router.cached_prefix(a) == {"p0": 0, "p1": 4}


def test_forwarder_numbers_events_and_resyncs_on_request() -> None:
    router, bus = _router()
    forwarder = attach_worker(bus, "p0")
    a, b = tokens(4, 16 * 4), tokens(5, 16 * 4)
    forwarder([_stored(router.hasher.hashes(a))])  # the engine thread: queued, not published
    router.sync()
    assert router.cached_prefix(a)["p0"] == 0
    assert forwarder.flush()
    forwarder.publish([_stored(router.hasher.hashes(b))])
    router.sync()
    assert router.cached_prefix(a)["p0"] == 4 and router.cached_prefix(b)["p0"] == 4
    assert forwarder.last_seq == 3  # the first snapshot, then two events

    # A router asks for snapshots: the forwarder's next resync republishes its mirror.
    bus.request_snapshots()
    forwarder([BlockRemoved(tuple(router.hasher.hashes(a)))])
    assert forwarder.resync()
    router.sync()
    assert router.cached_prefix(a)["p0"] == 0 and router.cached_prefix(b)["p0"] == 4
    assert router.status().event_gaps == 0


def test_full_queue_is_dropped_and_repaired_by_the_snapshot() -> None:
    router, bus = _router()
    forwarder = attach_worker(bus, "p0")
    forwarder.max_queued = 2
    prompts = [tokens(10 + i, 16 * 2) for i in range(3)]
    for prompt in prompts:  # three batches, nobody flushing: the queue overflows
        forwarder([_stored(router.hasher.hashes(prompt))])
    assert not forwarder.in_sync and forwarder.dropped > 0
    assert forwarder.resync()
    router.sync()
    assert all(router.cached_prefix(p)["p0"] == 2 for p in prompts)
