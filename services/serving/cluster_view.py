"""The gateway's picture of its workers, refreshed by polling them (and by their responses).

In-process mode it is also the router's registry feed and KV-event relay: each worker report
(load + buffered events) is registered in an ``InProcessRegistry`` and published on an
``InProcessEventBus``. With Redis the workers do that themselves and this only keeps stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle

from router import InProcessEventBus, InProcessRegistry, Router, WorkerInfo, WorkerLoad
from router.wire import decode_event
from services.engine.engine import EngineStats
from services.serving.replica_ids import known_replicas

log = logging.getLogger(__name__)


@dataclass
class WorkerSnapshot:
    worker_id: str
    role: str
    stats: EngineStats
    metrics: dict[str, Any] = field(default_factory=dict)
    leases: int = 0
    max_model_len: int = 0


class ClusterView:
    def __init__(self, router: Router, handles: Mapping[str, DeploymentHandle],
                 registry: InProcessRegistry | None, bus: InProcessEventBus | None,
                 poll_s: float) -> None:
        self.router = router
        self.handles = dict(handles)  # role -> deployment handle
        self.registry = registry
        self.bus = bus
        self.poll_s = poll_s
        self.workers: dict[str, WorkerSnapshot] = {}
        self._infos: dict[str, WorkerInfo] = {}
        self._report_seq: dict[str, int] = {}  # newest report applied, per worker
        self._task: asyncio.Task[None] | None = None

    def ingest(self, report: Mapping[str, Any]) -> None:
        """A worker's load and KV events, from a response or a status poll."""
        if self.bus is None:
            return
        worker_id = str(report["worker_id"])
        events = [decode_event(raw).event for raw in report.get("events", ())]
        if events:
            self.bus.publish(worker_id, events)
        seq = int(report["seq"])
        newest = seq > self._report_seq.get(worker_id, 0)
        info = self._infos.get(worker_id)
        if newest and info is not None and self.registry is not None:
            self._report_seq[worker_id] = seq
            self.registry.register(info, WorkerLoad(**report["load"]))
        self.router.sync()

    async def poll_once(self) -> None:
        for role, handle in self.handles.items():
            ids = known_replicas(handle.deployment_name)
            if not ids:  # the handle's request router learns the replicas on first use
                await self._status(handle, None)
                continue
            await asyncio.gather(*(self._poll(role, handle, rid) for rid in ids))
        for gone in set(self.workers) - self._live_ids():
            del self.workers[gone]
            self._infos.pop(gone, None)
            self._report_seq.pop(gone, None)
        self.router.sync()

    def _live_ids(self) -> set[str]:
        live: set[str] = set()
        for handle in self.handles.values():
            live |= known_replicas(handle.deployment_name)
        return live

    async def _poll(self, role: str, handle: DeploymentHandle, replica_id: str) -> None:
        status = await self._status(handle, replica_id)
        if status is None:
            return
        self.workers[replica_id] = WorkerSnapshot(
            replica_id, role, EngineStats(**status["engine"]), status.get("metrics", {}),
            int(status.get("leases", 0)), int(status["max_model_len"]))
        self._infos[replica_id] = WorkerInfo(**status["info"])
        self.ingest(status)

    async def _status(self, handle: DeploymentHandle, replica_id: str | None
                      ) -> dict[str, Any] | None:
        try:
            async with asyncio.timeout(max(5.0, 4 * self.poll_s)):
                return await handle.status.remote(route_to=replica_id)
        except Exception as exc:
            log.warning("status of %s %s failed: %r", handle.deployment_name, replica_id, exc)
            return None

    def count(self, role: str) -> int:
        return sum(1 for w in self.workers.values() if w.role == role)

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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll_once()
            except Exception:
                log.exception("polling the workers failed")
