"""Worker side of the router's inputs: numbered KV events and load, in-process or over Redis.

The engine thread hands each drained batch of KV events to ``WorkerEvents.on_engine_events``,
which only numbers, mirrors and queues them (``router.WorkerEventForwarder``); nothing on the
engine thread encodes or touches the network. Then:

- in-process mode (no ``redis_url``) the gateway owns the index: the queued events travel in the
  worker's next report (a response or a status poll, ``report_events``); when the gateway's
  router saw a gap in the numbers it asks for a snapshot with the next status poll;
- with Redis, a publisher thread sends them in pipelined batches to the Redis Stream, and a
  heartbeat task keeps the worker registered (and resyncs the stream when routers ask).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from router import (
    RedisRegistry,
    RedisStreamEventBus,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    attach_worker,
    connect,
)
from router.wire import WorkerEvent, encode_event
from services.engine.kv_events import KVEvent

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
    """One worker's KV-event forwarding and (with Redis) registry membership."""

    def __init__(self, worker_id: str, redis_url: str | None, heartbeat_s: float = 1.0) -> None:
        self.worker_id = worker_id
        self._redis_url = redis_url
        self._heartbeat_s = heartbeat_s
        self._load: Callable[[], WorkerLoad] | None = None
        self._report_bus: ReportBus | None = None
        self.membership: WorkerMembership | None = None
        if redis_url:
            self.forwarder = attach_worker(RedisStreamEventBus(connect(redis_url)), worker_id)
        else:
            self._report_bus = ReportBus()
            self.forwarder = attach_worker(self._report_bus, worker_id)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._publisher: threading.Thread | None = None
        self._heartbeat: asyncio.Task[None] | None = None

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

    def start(self, info: WorkerInfo, load: Callable[[], WorkerLoad]) -> None:
        """With Redis: register the worker, start publishing and heartbeating."""
        if not self._redis_url:
            return
        self._load = load
        self.membership = WorkerMembership(RedisRegistry(connect(self._redis_url)), info,
                                           self.forwarder)
        self.membership.join(load())
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True,
                                           name=f"kv-events-{self.worker_id}")
        self._publisher.start()
        self._heartbeat = asyncio.create_task(self._beat(), name="tandem-heartbeat")

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        self._stop.set()
        self._wake.set()
        if self._publisher is not None:
            await asyncio.to_thread(self._publisher.join, 5.0)
        if self.membership is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.membership.leave)

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(PUBLISH_IDLE_S)
            self._wake.clear()
            self.forwarder.flush()  # never raises; a failure marks it for resync

    async def _beat(self) -> None:
        assert self.membership is not None and self._load is not None
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await asyncio.to_thread(self.membership.heartbeat, self._load())
            except Exception:
                log.exception("%s: heartbeat failed", self.worker_id)
