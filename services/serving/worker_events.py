"""Worker side of the router's inputs: KV events and heartbeats, in-process or over Redis.

In-process mode the gateway owns the index: a worker buffers its engine's KV events and hands
them over with its responses and status polls (``drain``). With Redis, the worker publishes
them to the Redis Stream and heartbeats into the Redis registry itself (docs/router.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from router import (
    RedisRegistry,
    RedisStreamEventBus,
    WorkerInfo,
    WorkerLoad,
    WorkerMembership,
    attach_worker,
    connect,
)
from router.wire import encode_event
from services.engine.kv_events import KVEvent, KVEventPublisher

log = logging.getLogger(__name__)


class EventBuffer:
    """Collects a worker's KV events (engine thread) until the gateway takes them."""

    def __init__(self, publisher: KVEventPublisher, worker_id: str) -> None:
        self.worker_id = worker_id
        self._events: list[str] = []
        self._lock = threading.Lock()
        publisher.subscribe(self)

    def __call__(self, event: KVEvent) -> None:
        raw = encode_event(self.worker_id, event).decode()
        with self._lock:
            self._events.append(raw)

    def drain(self) -> list[str]:
        with self._lock:
            events, self._events = self._events, []
        return events


class RedisMembership:
    """Registers the worker in Redis and heartbeats every ``interval_s`` from a task."""

    def __init__(self, url: str, info: WorkerInfo, publisher: KVEventPublisher,
                 load: Callable[[], WorkerLoad], interval_s: float = 1.0) -> None:
        forwarder = attach_worker(publisher, RedisStreamEventBus(connect(url)), info.worker_id)
        self.membership = WorkerMembership(RedisRegistry(connect(url)), info, forwarder)
        self._load = load
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.membership.join(self._load())
        self._task = asyncio.create_task(self._beat(), name="tandem-heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.membership.leave)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await asyncio.to_thread(self.membership.heartbeat, self._load())
            except Exception:
                log.exception("%s: heartbeat failed", self.membership.info.worker_id)
