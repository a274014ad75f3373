"""The gateway's picture of its workers, refreshed by polling them (and by their responses).

In-process mode it is also the router's registry feed and KV-event relay: each worker report
(load + numbered events) is registered in an ``InProcessRegistry`` and published on an
``InProcessEventBus``. When the router finds a gap in a worker's event numbers it asks the bus
for snapshots; the next status poll (started at once) asks every worker for one. With Redis the
workers publish their events and heartbeat themselves; this keeps stats and registers the
workers it polls in a local registry, the router's fallback while Redis has no record of them
(``router.FallbackRegistry``). It never touches Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle

from tandem.router import InProcessEventBus, InProcessRegistry, Router, WorkerInfo
from tandem.router.wire import decode_event
from tandem.services.protocol.messages import WorkerReport
from tandem.services.protocol.outputs import EngineStats

log = logging.getLogger(__name__)

# Which replica ids each deployment has, as this process's Serve handles last heard
# (request_router.py records them; a module-level lock, as Serve pickles the request router
# class by value).
_replicas_lock = threading.Lock()
_replicas: dict[str, frozenset[str]] = {}  # deployment name -> replica ids


def record_replicas(deployment: str, replica_ids: frozenset[str]) -> None:
    with _replicas_lock:
        _replicas[deployment] = replica_ids


def known_replicas(deployment: str) -> frozenset[str]:
    with _replicas_lock:
        return _replicas.get(deployment, frozenset())


@dataclass
class WorkerSnapshot:
    worker_id: str
    role: str
    stats: EngineStats
    metrics: dict[str, Any] = field(default_factory=dict)
    leases: int = 0
    max_model_len: int = 0
    healthy: bool = True
    health_error: str | None = None  # why the worker's engine stopped
    kv_transport_fallback: str | None = None  # why "auto" could not use NIXL (a GPU worker)
    attention_backend: str = ""  # the one the engine runs (auto resolved)


IDLE_AFTER_POLLS = 4  # polls with no request in flight before the view polls at its idle pace


class ClusterView:
    def __init__(self, router: Router, handles: Mapping[str, DeploymentHandle],
                 registry: InProcessRegistry | None, bus: InProcessEventBus | None,
                 poll_s: float, idle_poll_s: float | None = None,
                 busy: Callable[[], bool] = lambda: True) -> None:
        self.router = router
        self.handles = dict(handles)  # role -> deployment handle
        self.registry = registry
        self.bus = bus
        self.poll_s = poll_s
        # Once ``busy()`` (requests in flight) has been false for IDLE_AFTER_POLLS polls, the
        # workers are polled every ``idle_poll_s`` only: an idle cluster costs next to nothing.
        # While busy, every response also carries its worker's report.
        self.idle_poll_s = max(poll_s, idle_poll_s if idle_poll_s is not None else poll_s)
        self.busy = busy
        self._last_poll = 0.0  # time.monotonic() when the latest poll started
        self._refreshing: asyncio.Task[None] | None = None  # a poll a /metrics scrape asked for
        self.workers: dict[str, WorkerSnapshot] = {}
        self._infos: dict[str, WorkerInfo] = {}
        self._report_seq: dict[str, int] = {}  # newest report applied, per worker
        self._task: asyncio.Task[None] | None = None
        self._generation = bus.generation() if bus is not None else ""
        self._snapshots_due = False
        self._unreachable: set[str] = set()  # workers whose last status poll failed
        self._resync: asyncio.Task[None] | None = None
        self._after_poll: list[Callable[[], None]] = []
        self._capacity: tuple[Callable[[int], None], int, int] | None = None

    def after_poll(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every poll (the workers' health and Serve's replica set
        are then as fresh as this view knows them)."""
        self._after_poll.append(callback)

    def follow_decode_capacity(self, set_limit: Callable[[int], None],
                               seqs_per_worker: int, gateways: int = 1) -> None:
        """Tell ``set_limit`` after every poll how many sequences the healthy decode workers
        batch in all, ``seqs_per_worker`` each (one worker's worth while none is healthy),
        shared by ``gateways`` gateway replicas (this one's share, rounded up)."""
        self._capacity = (set_limit, seqs_per_worker, gateways)

    def ingest(self, report: WorkerReport) -> None:
        """A worker's load and KV events, from a response or a status poll."""
        worker_id = report.worker_id
        events = [decode_event(raw) for raw in report.events]
        if events and self.bus is not None:
            self.bus.publish(events)
        known = self.workers.get(worker_id)
        newest = report.seq > self._report_seq.get(worker_id, 0) and (
            known is None or known.healthy)  # an unhealthy worker is never registered again
        info = self._infos.get(worker_id)
        if newest and info is not None and self.registry is not None:
            self._report_seq[worker_id] = report.seq
            self.registry.register(info, report.load)
        if self.bus is not None:  # with Redis the router syncs in its own thread
            self.router.sync()
            self._check_generation()

    def _check_generation(self) -> None:
        """The router asked for snapshots (a gap in some worker's events): poll now."""
        assert self.bus is not None
        generation = self.bus.generation()
        if generation == self._generation:
            return
        self._generation = generation
        self._snapshots_due = True
        if self._resync is None or self._resync.done():
            with contextlib.suppress(RuntimeError):  # no running loop: the next poll does it
                self._resync = asyncio.get_running_loop().create_task(self.poll_once())

    async def refresh(self, max_age_s: float) -> None:
        """Poll now unless a poll started within ``max_age_s`` (a /metrics scrape while the
        view polls at its idle pace). Waits at most ``max_age_s`` for it: a hung worker's
        status times out later, and the scrape shows what is known by then. Concurrent
        callers share one poll."""
        if time.monotonic() - self._last_poll < max_age_s:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._poll_logged())
        await asyncio.wait({self._refreshing}, timeout=max_age_s)

    async def poll_once(self) -> None:
        self._last_poll = time.monotonic()
        snapshot, self._snapshots_due = self._snapshots_due, False
        for role, handle in self.handles.items():
            ids = known_replicas(handle.deployment_name)
            if not ids:  # the handle's request router learns the replicas on first use
                await self._status(handle, None, snapshot)
                continue
            await asyncio.gather(*(self._poll(role, handle, rid, snapshot) for rid in ids))
        for gone in set(self.workers) - self._live_ids():
            if self.workers[gone].healthy and gone not in self._unreachable:
                self.router.mark_down(gone, "replica_gone")  # Serve saw it die: at once
            del self.workers[gone]
            self._infos.pop(gone, None)
            self._report_seq.pop(gone, None)
            self._unreachable.discard(gone)
        if self.bus is not None:  # with Redis the router syncs in its own thread
            self.router.sync()
        for callback in self._after_poll:
            callback()
        if self._capacity is not None:
            set_limit, seqs_per_worker, gateways = self._capacity
            set_limit(-(-seqs_per_worker * max(1, self.healthy_count("decode")) // gateways))

    def _live_ids(self) -> set[str]:
        live: set[str] = set()
        for handle in self.handles.values():
            live |= known_replicas(handle.deployment_name)
        return live

    async def _poll(self, role: str, handle: DeploymentHandle, replica_id: str,
                    snapshot: bool) -> None:
        status = await self._status(handle, replica_id, snapshot)
        if status is None:
            if snapshot:
                self._snapshots_due = True  # retry with the next poll
            if replica_id in self.workers and replica_id not in self._unreachable:
                # Dead or hung (its replacement has a new id): route around it now rather
                # than when its registration lapses; an answer to a later poll brings it back.
                self._unreachable.add(replica_id)
                self.router.mark_down(replica_id, "unreachable")
            return
        self._unreachable.discard(replica_id)
        healthy = bool(status.get("healthy", True))
        previous = self.workers.get(replica_id)
        was_healthy = previous is None or previous.healthy
        self.workers[replica_id] = WorkerSnapshot(
            replica_id, role, EngineStats(**status["engine"]), status.get("metrics", {}),
            int(status.get("leases", 0)), int(status["max_model_len"]), healthy,
            status.get("health_error"), status.get("kv_transport_fallback"),
            str(status.get("attention_backend", "")))
        self._infos[replica_id] = WorkerInfo(**status["info"])
        if not healthy:
            # Its engine stopped; Serve replaces the replica. Route around it now, and never
            # register it again (its replacement has a new id).
            if was_healthy:
                log.error("%s worker %s is unhealthy: %s", role, replica_id,
                          status.get("health_error"))
                self.router.mark_down(replica_id, "unhealthy")
            return
        self.ingest(status["report"])

    def health_problem(self) -> str | None:
        """None while some healthy prefill and decode worker is known; else what is missing."""
        missing = [role for role in self.handles
                   if not any(w.role == role and w.healthy for w in self.workers.values())]
        if not missing:
            return None
        return f"no healthy {' or '.join(missing)} worker"

    async def _status(self, handle: DeploymentHandle, replica_id: str | None,
                      snapshot: bool = False) -> dict[str, Any] | None:
        try:
            async with asyncio.timeout(max(5.0, 4 * self.poll_s)):
                return await handle.status.remote(route_to=replica_id, snapshot=snapshot)
        except Exception as exc:
            if replica_id is None and isinstance(exc, TimeoutError):
                # No replica known yet: they are starting (the ready line waits for them).
                log.debug("no %s replica answered yet", handle.deployment_name)
            else:
                log.warning("status of %s %s failed: %r", handle.deployment_name, replica_id,
                            exc)
            return None

    def count(self, role: str) -> int:
        return sum(1 for w in self.workers.values() if w.role == role)

    def healthy_count(self, role: str) -> int:
        return sum(1 for w in self.workers.values() if w.role == role and w.healthy)

    async def wait_for(self, counts: Mapping[str, int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.count(role) < n for role, n in counts.items()):
            if time.monotonic() > deadline:
                have = {role: self.count(role) for role in counts}
                raise TimeoutError(f"workers not ready after {timeout_s} s: have {have}, "
                                   f"want {dict(counts)}")
            await self.poll_once()
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tandem-cluster-view")

    async def close(self) -> None:
        for task in (self._task, self._resync, self._refreshing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _run(self) -> None:
        last_busy = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_s)
            now = time.monotonic()
            if self.busy():
                last_busy = now
            idle = now - last_busy > IDLE_AFTER_POLLS * self.poll_s
            if idle and now - self._last_poll < self.idle_poll_s:
                continue
            await self._poll_logged()

    async def _poll_logged(self) -> None:
        try:
            await self.poll_once()
        except Exception:
            log.exception("polling the workers failed")
