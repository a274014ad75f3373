"""The event bus for single-process runs: a bounded in-memory log with one cursor per reader."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from tandem.router.wire import WorkerEvent


class InProcessEventBus:
    """Thread-safe log of events; each subscription reads all of it at its own pace."""

    def __init__(self, max_events: int = 1_000_000) -> None:
        self._log: deque[WorkerEvent] = deque(maxlen=max_events)
        self._first_seq = 0  # sequence number of self._log[0]
        self._generation = 0
        self._cond = threading.Condition()

    def publish(self, events: Sequence[WorkerEvent]) -> None:
        with self._cond:
            for event in events:
                if len(self._log) == self._log.maxlen:
                    self._first_seq += 1
                self._log.append(event)
            self._cond.notify_all()

    def subscribe(self, replica_id: str) -> InProcessSubscription:
        return InProcessSubscription(self)

    def generation(self) -> str:
        with self._cond:
            return str(self._generation)

    def request_snapshots(self) -> None:
        with self._cond:
            self._generation += 1

    def _read(self, cursor: int, max_events: int, block_s: float) -> tuple[int, list[WorkerEvent]]:
        with self._cond:
            end = self._first_seq + len(self._log)
            if cursor >= end and block_s > 0:
                self._cond.wait_for(lambda: self._first_seq + len(self._log) > cursor, block_s)
                end = self._first_seq + len(self._log)
            cursor = max(cursor, self._first_seq)
            stop = min(end, cursor + max_events)
            base = self._first_seq
            events = [self._log[i - base] for i in range(cursor, stop)]
            return stop, events

    def _oldest(self) -> int:
        with self._cond:
            return self._first_seq


class InProcessSubscription:
    def __init__(self, bus: InProcessEventBus) -> None:
        self._bus = bus
        self._cursor = 0

    def open(self) -> None:
        self._cursor = self._bus._oldest()

    def read(self, max_events: int = 1000, block_s: float = 0.0) -> list[WorkerEvent]:
        self._cursor, events = self._bus._read(self._cursor, max_events, block_s)
        return events

    def close(self) -> None:
        pass
