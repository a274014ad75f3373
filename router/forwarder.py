"""Worker side: numbers a worker's KV events, mirrors its cache, and forwards them to a bus.

Two halves, two threads:

- ``__call__(events)`` takes a batch the engine drained with ``take_events()`` (vLLM's
  pattern). It runs on the engine thread, so it only mirrors the cached hashes, numbers the
  events 1, 2, 3, ... and queues them: no encoding, no network.
- ``flush()`` publishes what is queued, in order, from the worker's publisher (a background
  thread for Redis, the worker's report for the in-process bus). It never raises.

Whenever the bus may have lost events (a failed publish, a full queue, Redis restarted empty, a
router that saw a gap in the numbers and asked for snapshots), ``resync()`` queues the worker's
whole cache as ``AllBlocksCleared`` followed by ``BlockStored`` chunks. The snapshot is numbered
like any event, under the same lock as the mirror, so it is exactly the cache as of its number:
a router resets the worker's entries at the ``AllBlocksCleared`` and drops older numbers.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

from tandem.router.bus import EventBus
from tandem.router.errors import BusUnavailable
from tandem.router.wire import WorkerEvent
from tandem.services.protocol.kv_events import (
    DEVICE,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
)

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 4096
MAX_QUEUED_EVENTS = 100_000  # past this the queue is dropped and the next resync repairs it


class WorkerEventForwarder:
    """Thread-safe. Call ``flush()`` after events arrive and ``resync()`` with every heartbeat."""

    def __init__(self, bus: EventBus, worker_id: str,
                 max_queued: int = MAX_QUEUED_EVENTS) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.max_queued = max_queued
        self._block_size = 0  # learned from BlockStored; only needed once blocks are held
        # Per tier, the insertion-ordered set of cached block hashes
        self._held: dict[Medium, dict[bytes, None]] = {DEVICE: {}, HOST: {}}
        self._seq = 0  # number of the last event queued
        self._queue: deque[WorkerEvent] = deque()
        self._lock = threading.Lock()  # mirror, numbers and queue
        self._publishing = threading.Lock()  # one publisher at a time keeps the order
        self._dirty = True  # the bus has not seen a snapshot of this worker yet
        self._generation: str | None = None
        self.dropped = 0  # events dropped because the queue was full or the bus down

    @property
    def in_sync(self) -> bool:
        return not self._dirty

    @property
    def last_seq(self) -> int:
        return self._seq

    def __call__(self, events: Sequence[KVEvent]) -> None:
        """Mirror, number and queue a batch of events (cheap: called on the engine thread)."""
        with self._lock:
            for event in events:
                self._mirror(event)
            if self._dirty:
                # Out of sync anyway: the next resync() sends a snapshot, so an unreachable bus
                # costs one failed attempt per heartbeat, not one per event.
                return
            self._enqueue(events)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Queue and flush at once (tests, simulations and single-threaded callers)."""
        self(events)
        return self.flush()

    def flush(self) -> bool:
        """Publish the queued events in order. False if the bus failed (a resync follows)."""
        with self._publishing:
            with self._lock:
                batch = list(self._queue)
                self._queue.clear()
            if not batch:
                return True
            try:
                self.bus.publish(batch)
            except BusUnavailable as exc:
                with self._lock:
                    if not self._dirty:
                        log.warning("worker %s: %d KV events not delivered (%s); will resync",
                                    self.worker_id, len(batch), exc)
                    self._dirty = True
                    self.dropped += len(batch)
                return False
            return True

    def resync(self, force: bool = False) -> bool:
        """Republish the whole cache if the bus may have lost events. True if it is in sync."""
        try:
            generation = self.bus.generation()
        except BusUnavailable:
            with self._lock:
                self._dirty = True
            return False
        with self._lock:
            if not force and not self._dirty and generation == self._generation:
                return True
            self._queue.clear()  # the snapshot supersedes whatever was still queued
            self._enqueue(self._snapshot())
            self._dirty = False
            self._generation = generation
        return self.flush()

    # -- under self._lock ------------------------------------------------------------------

    def _enqueue(self, events: Sequence[KVEvent]) -> None:
        if len(self._queue) + len(events) > self.max_queued:
            log.warning("worker %s: KV event queue full (%d); dropping it, will resync",
                        self.worker_id, len(self._queue))
            self.dropped += len(self._queue) + len(events)
            self._queue.clear()
            self._dirty = True
            return
        for event in events:
            self._seq += 1
            self._queue.append(WorkerEvent(self.worker_id, event, self._seq))

    def _snapshot(self) -> list[KVEvent]:
        events: list[KVEvent] = [AllBlocksCleared()]
        for medium, held_set in self._held.items():
            held = list(held_set)
            for start in range(0, len(held), SNAPSHOT_CHUNK):
                chunk = tuple(held[start : start + SNAPSHOT_CHUNK])
                events.append(BlockStored(chunk, None, self._block_size, medium))
        return events

    def _mirror(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._block_size = event.block_size
            held = self._held[event.medium]
            for block_hash in event.block_hashes:
                held[block_hash] = None
        elif isinstance(event, BlockRemoved):
            held = self._held[event.medium]
            for block_hash in event.block_hashes:
                held.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            for held in self._held.values():
                held.clear()


def attach_worker(bus: EventBus, worker_id: str) -> WorkerEventForwarder:
    """A forwarder for ``worker_id`` that has announced the worker's (empty) cache.

    The first snapshot tells routers to drop whatever an earlier process with the same worker id
    left in their index. Feed it the engine's drained events (``AsyncEngine(on_events=...)``).
    """
    forwarder = WorkerEventForwarder(bus, worker_id)
    forwarder.resync(force=True)
    return forwarder
