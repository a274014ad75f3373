"""Worker side: forwards a block manager's KV events to the bus, tagged with the worker id.

The forwarder mirrors which blocks the worker holds, so that whenever the bus may have lost
events (a failed publish, Redis restarted empty, a router asked for snapshots) it republishes
the worker's whole cache as ``AllBlocksCleared`` followed by ``BlockStored`` chunks. A failing
bus never raises into the engine: events are dropped and the next resync repairs the index.
"""

from __future__ import annotations

import logging
import threading

from router.bus import EventBus
from router.errors import BusUnavailable
from services.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventPublisher,
)

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 4096


class WorkerEventForwarder:
    """A ``KVEventPublisher`` subscriber. Call ``resync()`` with every heartbeat.

    Publishing is synchronous (one pipelined XADD per event on Redis). Thread-safe.
    """

    def __init__(self, bus: EventBus, worker_id: str) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self._block_size = 0  # learned from BlockStored; only needed once blocks are held
        self._held: dict[bytes, None] = {}  # insertion-ordered set of cached block hashes
        self._lock = threading.Lock()
        self._dirty = True  # the bus has not seen a snapshot of this worker yet
        self._generation: str | None = None

    @property
    def in_sync(self) -> bool:
        return not self._dirty

    def __call__(self, event: KVEvent) -> None:
        with self._lock:
            self._mirror(event)
            # While out of sync, only mirror: the next resync() (heartbeat) sends a snapshot, so
            # an unreachable bus costs one failed attempt per heartbeat, not one per event.
            if not self._dirty:
                self._publish([event])

    def resync(self, force: bool = False) -> bool:
        """Republish the whole cache if the bus may have lost events. True if it is in sync."""
        with self._lock:
            if not force and not self._dirty:
                try:
                    if self.bus.generation() == self._generation:
                        return True
                except BusUnavailable:
                    self._dirty = True
                    return False
            return self._publish_snapshot()

    def _mirror(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._block_size = event.block_size
            for block_hash in event.block_hashes:
                self._held[block_hash] = None
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._held.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            self._held.clear()

    def _publish(self, events: list[KVEvent]) -> bool:
        try:
            self.bus.publish(self.worker_id, events)
        except BusUnavailable as exc:
            if not self._dirty:
                log.warning("worker %s: KV events not delivered (%s); will resync", self.worker_id,
                            exc)
            self._dirty = True
            return False
        return True

    def _publish_snapshot(self) -> bool:
        try:
            generation = self.bus.generation()
        except BusUnavailable:
            self._dirty = True
            return False
        held = list(self._held)
        events: list[KVEvent] = [AllBlocksCleared()]
        for start in range(0, len(held), SNAPSHOT_CHUNK):
            chunk = tuple(held[start : start + SNAPSHOT_CHUNK])
            events.append(BlockStored(chunk, None, self._block_size))
        if not self._publish(events):
            return False
        self._dirty = False
        self._generation = generation
        return True


def attach_worker(
    publisher: KVEventPublisher, bus: EventBus, worker_id: str
) -> WorkerEventForwarder:
    """Subscribe a forwarder to ``publisher`` and announce the worker's (empty) cache.

    The first snapshot tells routers to drop whatever an earlier process with the same worker id
    left in their index.
    """
    forwarder = WorkerEventForwarder(bus, worker_id)
    publisher.subscribe(forwarder)
    forwarder.resync(force=True)
    return forwarder
