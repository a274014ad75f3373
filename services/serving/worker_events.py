"""Worker side of the router's inputs: numbered KV events and load, in-process or over Redis.

The engine thread hands each drained batch of KV events to ``WorkerEvents.on_engine_events``,
which only numbers, mirrors and queues them (``router.WorkerEventForwarder``); nothing on the
engine thread encodes or touches the network. Then:

- in-process mode (no ``redis_url``) the gateway owns the index: the queued events travel in the
  worker's next report (a response or a status poll, ``report_events``); when the gateway's
  router saw a gap in the numbers it asks for a snapshot with the next status poll;
- with Redis, one background thread sends them in pipelined batches to the Redis Stream and
  heartbeats, which keeps the worker registered (and resyncs the stream when routers ask, or
  after any failure). Redis may be down, read-only or full: the worker starts and serves all
  the same, and catches up when Redis accepts writes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from tandem.router import (
    RedisRegistry,
    RedisStreamEventBus,
    RegistrationRefused,
    WorkerEventForwarder,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    attach_worker,
    connect,
)
from tandem.router.wire import WorkerEvent, encode_event
from tandem.services.protocol.kv_events import KVEvent

log = logging.getLogger(__name__)

PUBLISH_IDLE_S = 0.05  # the Redis publisher's longest sleep between checks


class ReportBus:
    """The in-process mode's ``EventBus``: holds a worker's published events (wire-encoded)
    until its next report takes them. Snapshots are asked for by the gateway, per report."""

    def __init__(self) -> None:
        self._events: list[str] = []
        self._lock = threading.Lock()

    def publish(self, events: Sequence[WorkerEvent]) -> None:
        encoded = [encode_event(e.worker_id, e.event, e.seq).decode() for e in events]
        with self._lock:
            self._events.extend(encoded)

    def drain(self) -> list[str]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def generation(self) -> str:
        return "report"

    def request_snapshots(self) -> None:  # the gateway asks through the status call instead
        pass

    def subscribe(self, replica_id: str):  # type: ignore[no-untyped-def]
        raise NotImplementedError("reports are read by the gateway, not subscribed to")


class WorkerEvents:
    """One worker's KV-event forwarding and (with Redis) registry membership.

    Redis is never on the engine's or the replica's path, and never needed to start: one
    background thread does all of its I/O (heartbeats and publishing), and each failure, be it
    a refused connection, a timeout or an error reply (READONLY, OOM), only marks the forwarder
    for a resync. The first heartbeat that reaches Redis registers the worker and republishes
    its whole cache.
    """

    def __init__(self, worker_id: str, redis_url: str | None, heartbeat_s: float = 1.0) -> None:
        self.worker_id = worker_id
        self._redis_url = redis_url
        self._heartbeat_s = heartbeat_s
        self._report_bus: ReportBus | None = None
        self.membership: WorkerMembership | None = None
        if redis_url:
            # Out of sync until the first heartbeat gets through (then it sends a snapshot of
            # the cache); nothing here touches Redis.
            self.forwarder = WorkerEventForwarder(RedisStreamEventBus(connect(redis_url)),
                                                  worker_id)
        else:
            self._report_bus = ReportBus()
            self.forwarder = attach_worker(self._report_bus, worker_id)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_engine_events(self, events: list[KVEvent]) -> None:
        """The engine thread's sink (``AsyncEngine(on_events=...)``): cheap, never blocks."""
        self.forwarder(events)
        self._wake.set()

    def report_events(self, snapshot: bool = False) -> list[str]:
        """In-process mode: the events queued since the last report (a snapshot first if the
        gateway asked), wire-encoded, for the report. Empty with Redis."""
        if self._report_bus is None:
            return []
        if snapshot:
            self.forwarder.resync(force=True)
        self.forwarder.flush()
        return self._report_bus.drain()

    def start(self, info: WorkerInfo, load: Callable[[], WorkerLoad],
              healthy: Callable[[], bool] = lambda: True) -> None:
        """With Redis: start the thread that registers, heartbeats and publishes. Returns at
        once, whether Redis is up or not. Once ``healthy()`` is False (the engine stopped) the
        worker leaves the registry and stops heartbeating, so routers never pick it again."""
        if not self._redis_url:
            return
        self.membership = WorkerMembership(RedisRegistry(connect(self._redis_url)), info,
                                           self.forwarder)
        self._thread = threading.Thread(target=self._run, args=(self.membership, load, healthy),
                                        daemon=True, name=f"redis-{self.worker_id}")
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self.membership is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.membership.leave)

    def _run(self, membership: WorkerMembership, load: Callable[[], WorkerLoad],
             healthy: Callable[[], bool]) -> None:
        """Heartbeat every ``heartbeat_s`` (the first at once), publish whenever events come."""
        next_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                if not healthy():
                    log.error("%s: the engine stopped; leaving the registry", self.worker_id)
                    membership.leave()
                    return
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self._heartbeat_s
                    membership.heartbeat(load())  # False while Redis is unusable
                self.forwarder.flush()  # False on failure: the next heartbeat resyncs
            except RegistrationRefused:
                pass  # logged with its reason; routers refuse this worker as well
            except Exception:  # a bug: log, never stop
                log.exception("%s: Redis heartbeat or publish failed", self.worker_id)
            self._wake.wait(min(PUBLISH_IDLE_S, max(next_beat - time.monotonic(), 0.0)))
            self._wake.clear()
