"""Paged KV block allocation with hash-chained prefix caching.

Blocks have reference counts. A full block gets a chained hash and enters the prefix cache; when
its last reference goes it joins the free queue but stays hittable until the queue hands it out
again (LRU eviction). Stored and evicted blocks are announced as KV events for the router:
queued here in emission order and handed out by ``take_events`` (never published from here).

With a ``HostKVPool`` (the host-memory tier) an evicted block's bytes go to the pool first, and
a prefix lookup goes on past the device-cached blocks into the pool: a hash held there is copied
back into a free device block, which becomes an ordinary cached block (a hit; its tokens are not
recomputed). Events carry the tier (``medium``): an eviction to the pool is ``BlockRemoved`` on
the device and ``BlockStored`` in host memory; the pool dropping a hash is ``BlockRemoved`` there.

The block manager writes a sequence's block state (``block_ids``, ``block_hashes``,
``num_registered_blocks``) but never its ``num_computed_tokens``: the scheduler owns that.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.services.engine.sequence import Sequence
from tandem.services.protocol.block_hash import BlockHash, hash_block
from tandem.services.protocol.kv_events import HOST, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from tandem.services.engine.host_kv_pool import HostKVPool


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_pool: HostKVPool | None = None) -> None:
        self.block_size = block_size
        self.host_pool = host_pool if enable_prefix_caching else None
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._events: list[KVEvent] = []  # not yet taken, in emission order
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first; cached ones stay in cached_blocks.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last call, in emission order; the queue is cleared."""
        events, self._events = self._events, []
        return events

    # -- admission ------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, leaving >= 1 token to compute
        (none for a request that wants its prompt's logprobs: cached blocks have no logits).
        Blocks found only in the host pool are copied back into free device blocks on the way,
        only while the free blocks can hold all of ``seq`` (so a sequence that cannot be admitted
        does not churn blocks between the tiers); a restored block is an ordinary cached one."""
        if not self.enable_prefix_caching or seq.prompt_logprob_positions:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        num_free_hits = 0  # unreferenced hits, moved to the free queue's far end: kept there
        parent: BlockHash | None = None
        for i in range(max_blocks):
            if i < len(seq.block_hashes):
                parent = seq.block_hashes[i]
            else:
                tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
                parent = hash_block(parent, tokens, seq.extra_keys)
                seq.block_hashes.append(parent)
            block_id = self.cached_blocks.get(parent)
            if block_id is None:
                room = self.num_free_blocks - num_free_hits
                fits = room >= self.blocks_needed(seq.num_tokens) - len(hits)
                block_id = self._restore(parent, num_free_hits) if fits else None
                if block_id is None:
                    break
            if self.host_pool is not None and self.blocks[block_id].ref_count == 0:
                self.free_queue.move_to_end(block_id)
                num_free_hits += 1
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return needed <= self.num_free_blocks - revived

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give ``seq`` the cached prefix blocks; the caller records them as computed
        (``num_cached_tokens``) and allocates the rest."""
        for block_id in cached:
            self._ref(block_id)
        seq.block_ids = list(cached)
        seq.num_registered_blocks = len(cached)
        seq.num_cached_tokens = len(cached) * self.block_size
        self.stats.queries += seq.num_tokens
        self.stats.hits += seq.num_cached_tokens

    # -- growth and release ---------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Ensure blocks for ``num_computed_tokens + num_new_tokens``; False if out of blocks."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_ids.append(self._pop_free())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the tail blocks ``seq`` holds beyond ``num_tokens`` tokens (KV of rejected
        speculative tokens). Those blocks were never full of computed tokens, so no prefix-cache
        entry points at them."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_ids[keep:]):
            block = self.blocks[block_id]
            assert block.block_hash is None, "a trimmed block must not be in the prefix cache"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        del seq.block_ids[keep:]

    def free(self, seq: Sequence) -> None:
        # Tail blocks go to the free queue first so a chain's prefix outlives its suffix.
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of ``seq`` that became full with computed tokens and queue their
        ``BlockStored`` event."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(start, num_full):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, tokens, seq.extra_keys)
            seq.block_hashes.append(parent)
        stored: list[BlockHash] = []
        first_parent: BlockHash | None = None
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_ids[i]]
            block_hash = seq.block_hashes[i]
            if block_hash in self.cached_blocks:
                continue  # another block holds the same content; keep that one
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block.block_id
            if not stored:
                first_parent = seq.block_hashes[i - 1] if i else None
            stored.append(block_hash)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        if stored:
            self._events.append(BlockStored(tuple(stored), first_parent, self.block_size))

    # -- internals ------------------------------------------------------------------------

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict
            del self.cached_blocks[block.block_hash]
            self._events.append(BlockRemoved((block.block_hash,)))
            if self.host_pool is not None:
                self._offload(block)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _offload(self, block: Block) -> None:
        """Keep an evicted block's bytes in the host pool (before anything overwrites them)."""
        assert self.host_pool is not None and block.block_hash is not None
        stored = block.block_hash not in self.host_pool
        dropped = self.host_pool.store(block.block_hash, block.block_id)
        if dropped is not None:
            self._events.append(BlockRemoved((dropped,), HOST))
        if stored:
            self._events.append(BlockStored((block.block_hash,), None, self.block_size, HOST))

    def _restore(self, block_hash: BlockHash, num_free_hits: int) -> int | None:
        """Copy ``block_hash``'s bytes from the host pool into a free device block and cache it
        there (unreferenced, most recently freed); None if the pool lacks it or no free block is
        left besides the ``num_free_hits`` at the free queue's end."""
        pool = self.host_pool
        if pool is None or block_hash not in pool or self.num_free_blocks <= num_free_hits:
            return None
        pool.touch(block_hash)  # so the eviction below does not drop it
        block_id = self._pop_free()
        block = self.blocks[block_id]
        block.ref_count = 0
        self.free_queue[block_id] = None
        if block_hash not in pool:  # a pool of one block: the eviction took its place
            self.free_queue.move_to_end(block_id, last=False)
            return None
        pool.load(block_hash, block_id)
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block_id
        self._events.append(BlockStored((block_hash,), None, self.block_size))
        return block_id
