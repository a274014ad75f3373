"""KV cache events a worker's block manager emits, for the router's prefix index.

Plain dataclasses and a subscriber list: no transport here. The worker layer forwards events to
a bus (in-process or Redis Streams) tagged with its worker id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.engine.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became reusable prefix-cache entries, in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted and can no longer be hit."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (e.g. a reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSubscriber = Callable[[KVEvent], None]


class KVEventPublisher:
    """Fans events out to subscribers, synchronously, in emission order."""

    def __init__(self) -> None:
        self._subscribers: list[KVEventSubscriber] = []

    def subscribe(self, subscriber: KVEventSubscriber) -> None:
        self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: KVEventSubscriber) -> None:
        self._subscribers.remove(subscriber)

    def publish(self, event: KVEvent) -> None:
        for subscriber in self._subscribers:
            subscriber(event)
