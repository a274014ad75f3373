"""Interfaces of the KV-event bus that carries workers' events to every router replica."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.router.wire import WorkerEvent


class EventSubscription(Protocol):
    """One router replica's cursor on the bus: it sees every event, in publication order."""

    def open(self) -> None:
        """Position the cursor at the oldest retained event. Raises BusUnavailable."""
        ...

    def read(self, max_events: int = 1000, block_s: float = 0.0) -> list[WorkerEvent]:
        """Next events, waiting up to ``block_s`` when none is ready.

        Raises BusUnavailable when the bus cannot be reached and BusReset when its history was
        lost (the caller then clears its index and calls ``open`` again).
        """
        ...

    def close(self) -> None: ...


class EventBus(Protocol):
    """Carries workers' KV events to every router replica."""

    def publish(self, events: Sequence[WorkerEvent]) -> None:
        """Append workers' events in order (atomically as a batch). Raises BusUnavailable."""
        ...

    def subscribe(self, replica_id: str) -> EventSubscription: ...

    def generation(self) -> str:
        """Changes whenever workers must republish their full cache contents: the bus lost its
        history (server restart) or a router asked for snapshots. Raises BusUnavailable."""
        ...

    def request_snapshots(self) -> None:
        """Ask every worker to republish its full cache contents. Raises BusUnavailable."""
        ...
