"""The router's own assignments that workers have not reported yet.

A heartbeat's load is already stale when it arrives; without counting what it has just sent, a
router would send a whole burst to the worker that looked idle at the last heartbeat. An entry
counts until the worker reports a heartbeat taken after it, the caller releases the request, or
``max_age_s`` passes.

The reverse staleness matters too: a heartbeat sampled while a request was in flight keeps
counting it after its prefill is done. A released request that a heartbeat had already counted
becomes a credit against that worker's reported load until its next heartbeat; without it, a
client sending one request at a time is steered away from the worker holding its prefix.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Assignment:
    request_id: str
    worker_id: str
    assigned_at: float
    blocks: int  # prefill: blocks to compute; decode: prompt blocks to hold


class InFlight:
    """Not thread-safe on its own; the router serialises access."""

    def __init__(self, max_age_s: float = 30.0) -> None:
        self.max_age_s = max_age_s
        self._by_worker: dict[str, list[_Assignment]] = defaultdict(list)
        self._by_request: dict[str, list[_Assignment]] = defaultdict(list)
        self._blocks: dict[str, int] = defaultdict(int)
        # Assignments a worker's heartbeat has counted and the caller has not released yet.
        self._reported: dict[str, list[_Assignment]] = defaultdict(list)
        self._credit: dict[str, int] = defaultdict(int)  # released since the last heartbeat

    def add(self, request_id: str, worker_id: str, blocks: int, now: float) -> None:
        entry = _Assignment(request_id, worker_id, now, blocks)
        self._by_worker[worker_id].append(entry)
        self._by_request[request_id].append(entry)
        self._blocks[worker_id] += blocks

    def release(self, request_id: str) -> None:
        for entry in self._by_request.pop(request_id, ()):
            self._remove_from_worker(entry.worker_id, lambda e, target=entry: e is target)
        for counted in self._reported.pop(request_id, ()):
            self._credit[counted.worker_id] += counted.blocks

    def reported(self, worker_id: str, heartbeat_at: float) -> None:
        """The worker's load sampled at ``heartbeat_at`` already includes earlier assignments."""
        self._credit.pop(worker_id, None)
        self._remove_from_worker(worker_id, lambda e: e.assigned_at <= heartbeat_at, unlink=True,
                                 counted=True)

    def credit(self, worker_id: str) -> int:
        """Blocks the worker's last heartbeat counted for requests released since."""
        return self._credit.get(worker_id, 0)

    def expire(self, now: float) -> None:
        for worker_id in list(self._by_worker):
            self._remove_from_worker(
                worker_id, lambda e: now - e.assigned_at > self.max_age_s, unlink=True
            )
        self._drop_reported(lambda e: now - e.assigned_at > self.max_age_s)

    def blocks(self, worker_id: str) -> int:
        return self._blocks.get(worker_id, 0)

    def count(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def forget_worker(self, worker_id: str) -> None:
        self._remove_from_worker(worker_id, lambda e: True, unlink=True)
        self._credit.pop(worker_id, None)
        self._drop_reported(lambda e: e.worker_id == worker_id)

    def _drop_reported(self, drop: Callable[[_Assignment], bool]) -> None:
        for request_id, entries in list(self._reported.items()):
            entries[:] = [e for e in entries if not drop(e)]
            if not entries:
                del self._reported[request_id]

    def _remove_from_worker(
        self, worker_id: str, drop: Callable[[_Assignment], bool], unlink: bool = False,
        counted: bool = False,
    ) -> None:
        entries = self._by_worker.get(worker_id)
        if not entries:
            return
        keep = []
        for entry in entries:
            if not drop(entry):
                keep.append(entry)
                continue
            self._blocks[worker_id] -= entry.blocks
            if counted:
                self._reported[entry.request_id].append(entry)
            if unlink:
                siblings = self._by_request.get(entry.request_id)
                if siblings is not None:
                    siblings[:] = [e for e in siblings if e is not entry]
                    if not siblings:
                        del self._by_request[entry.request_id]
        if keep:
            self._by_worker[worker_id] = keep
        else:
            del self._by_worker[worker_id]
            self._blocks.pop(worker_id, None)
