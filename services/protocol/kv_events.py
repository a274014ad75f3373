"""KV cache events a worker's block manager emits, for the router's prefix index.

Plain dataclasses, no transport. The block manager queues them as it goes; whoever runs the
engine drains them with ``LLMEngine.take_events()`` between steps (``AsyncEngine`` hands each
batch to its ``on_events`` callback) and forwards them to a bus, tagged with its worker id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.services.protocol.block_hash import BlockHash

Medium = Literal["device", "host"]  # which tier holds a block: the device's KV cache or host RAM
DEVICE: Medium = "device"
HOST: Medium = "host"


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became reusable prefix-cache entries, in chain order, in ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    block_size: int
    medium: Medium = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted from ``medium`` and can no longer be hit there."""

    block_hashes: tuple[BlockHash, ...]
    medium: Medium = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped; a worker's snapshot of its cache starts with it."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
