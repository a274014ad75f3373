"""The host-memory KV tier: a bounded LRU pool of evicted prefix-cache blocks' bytes.

When the block manager hands out a free block that still holds a cached hash (an eviction), the
block's bytes are copied here first, keyed by the hash; a later prefix lookup that misses on the
device but finds the hash here copies the bytes back into a fresh device block instead of
recomputing its tokens. A block is copied as bytes (``block_bytes`` of the cache's one storage
tensor), so a bfloat16 cache and an int8 cache (values and scales) travel alike, and a restored
block holds exactly the bytes that were computed. Pinned memory when the cache is on CUDA.

Copies to the host are synchronous: the evicted block is about to be overwritten (by the next
step or by a KV transfer that does not follow the stream), so its bytes must be out first.
Copies back are stream-ordered before the step that reads them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tandem.services.engine.kv_cache import KVCache, block_bytes, kv_storage
from tandem.services.protocol.block_hash import BlockHash


def host_pool_blocks(host_kv_cache_gb: float, bytes_per_block: int) -> int:
    """How many blocks ``host_kv_cache_gb`` holds; raises if it holds none."""
    capacity = int(host_kv_cache_gb * 2**30) // bytes_per_block
    if capacity < 1:
        raise ValueError(f"host_kv_cache_gb of {host_kv_cache_gb} GiB holds no "
                         f"{bytes_per_block}-byte KV block")
    return capacity


class HostKVPool:
    """Block hash -> a slot of host memory holding that block's bytes; least recently used out."""

    def __init__(self, kv_cache: KVCache, capacity: int) -> None:
        self._device_blocks = block_bytes(kv_storage(kv_cache))  # [num_blocks, bytes] view
        pin = self._device_blocks.device.type == "cuda"
        self._slots = torch.empty((capacity, self._device_blocks.shape[1]), dtype=torch.uint8,
                                  pin_memory=pin)
        self._non_blocking = pin
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # least recent first
        self._free_slots = list(range(capacity - 1, -1, -1))
        self.capacity = capacity
        self.offloaded = 0  # blocks copied to the pool
        self.restored = 0  # blocks copied back (host-tier hits)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def touch(self, block_hash: BlockHash) -> None:
        self._slot_of.move_to_end(block_hash)

    def store(self, block_hash: BlockHash, block_id: int) -> BlockHash | None:
        """Keep device block ``block_id``'s bytes under ``block_hash`` (only touched if already
        held: a hash names its bytes). Returns the hash dropped to make room, if any."""
        if block_hash in self._slot_of:
            self.touch(block_hash)
            return None
        dropped = None
        if not self._free_slots:
            dropped, slot = self._slot_of.popitem(last=False)
            self._free_slots.append(slot)
        slot = self._free_slots.pop()
        self._slots[slot].copy_(self._device_blocks[block_id])
        self._slot_of[block_hash] = slot
        self.offloaded += 1
        return dropped

    def load(self, block_hash: BlockHash, block_id: int) -> None:
        """Copy the bytes held under ``block_hash`` into device block ``block_id``."""
        slot = self._slot_of[block_hash]
        self._slot_of.move_to_end(block_hash)
        self._device_blocks[block_id].copy_(self._slots[slot], non_blocking=self._non_blocking)
        self.restored += 1
