"""Prefix index: block hash -> workers holding it, from KV events plus provisional entries.

Two tiers per worker: its device KV cache and its host-memory tier (``medium`` "host" events).
An engine reuses a prefix block from either (a host block is copied back), so a prefix runs
while each block is held in some tier; the blocks held only in host memory are counted apart,
since copying one back costs more than a device hit and less than a miss.

Workers are bits of an int mask, so the per-block work of a lookup is one dict probe and one AND,
and the big dicts hold no containers (they cost the garbage collector nothing). Not thread-safe
on its own; the router serialises access.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

from tandem.services.protocol.block_hash import BlockHash
from tandem.services.protocol.kv_events import (
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

log = logging.getLogger(__name__)


class PrefixIndex:
    """Confirmed entries come from workers' events; provisional ones from the router's own
    decisions and expire after ``provisional_ttl_s`` (so a burst sharing a prefix stays together
    before the chosen worker's events arrive)."""

    def __init__(self, block_size: int, provisional_ttl_s: float = 2.0) -> None:
        self.block_size = block_size
        self.provisional_ttl_s = provisional_ttl_s
        self._bit_of: dict[str, int] = {}
        self._worker_of: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._confirmed: dict[BlockHash, int] = {}  # hash -> mask of workers
        self._by_worker: dict[str, dict[BlockHash, None]] = {}
        self._host: dict[BlockHash, int] = {}  # the host-memory tier: hash -> mask of workers
        self._host_by_worker: dict[str, dict[BlockHash, None]] = {}
        # hash -> (mask, expiry). One expiry per hash, the latest of its entries: a worker's
        # entry may outlive its own TTL by at most one TTL when another worker refreshes it.
        self._provisional: dict[BlockHash, tuple[int, float]] = {}
        self._expiries: deque[tuple[float, tuple[BlockHash, ...]]] = deque()
        self._warned_block_sizes: set[tuple[str, int]] = set()

    # -- feeding ---------------------------------------------------------------------------

    def apply(self, worker_id: str, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            if event.block_size != self.block_size:
                if (worker_id, event.block_size) not in self._warned_block_sizes:
                    self._warned_block_sizes.add((worker_id, event.block_size))
                    log.warning("ignoring events of worker %s: block size %d, router uses %d",
                                worker_id, event.block_size, self.block_size)
                return
            bit = self._bit(worker_id)
            host = event.medium == HOST
            held = (self._host_by_worker if host else self._by_worker).setdefault(worker_id, {})
            confirmed = self._host if host else self._confirmed
            for block_hash in event.block_hashes:
                confirmed[block_hash] = confirmed.get(block_hash, 0) | bit
                held[block_hash] = None
        elif isinstance(event, BlockRemoved):
            bit = self._bit_of.get(worker_id)
            if bit is None:
                return
            if event.medium == HOST:
                held = self._host_by_worker.get(worker_id, {})
                for block_hash in event.block_hashes:
                    held.pop(block_hash, None)
                    _unset_bit(self._host, block_hash, bit)
                return
            held = self._by_worker.get(worker_id, {})
            for block_hash in event.block_hashes:
                held.pop(block_hash, None)
                self._unset(block_hash, bit)
        elif isinstance(event, AllBlocksCleared):
            # Provisional entries stay: they stand for requests just sent, not yet computed.
            self._clear_confirmed(worker_id)

    def add_provisional(self, worker_id: str, hashes: Sequence[BlockHash], now: float) -> None:
        if not hashes or self.provisional_ttl_s <= 0:
            return
        bit = self._bit(worker_id)
        expiry = now + self.provisional_ttl_s
        provisional = self._provisional
        for block_hash in hashes:
            entry = provisional.get(block_hash)
            provisional[block_hash] = (entry[0] | bit if entry else bit, expiry)
        self._expiries.append((expiry, tuple(hashes)))

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything about a worker, provisional entries included."""
        self._clear_confirmed(worker_id)
        bit = self._bit_of.pop(worker_id, None)
        if bit is None:
            return
        for block_hash in [h for h, (mask, _) in self._provisional.items() if mask & bit]:
            self._unset_provisional(block_hash, bit)
        del self._worker_of[bit]
        self._free_bits.append(bit)
        self._by_worker.pop(worker_id, None)
        self._host_by_worker.pop(worker_id, None)

    def clear(self) -> None:
        self._bit_of.clear()
        self._worker_of.clear()
        self._free_bits.clear()
        self._confirmed.clear()
        self._by_worker.clear()
        self._host.clear()
        self._host_by_worker.clear()
        self._provisional.clear()
        self._expiries.clear()

    def expire(self, now: float) -> None:
        """Drop provisional entries whose TTL has passed (lookups ignore them anyway)."""
        provisional = self._provisional
        while self._expiries and self._expiries[0][0] <= now:
            _, hashes = self._expiries.popleft()
            for block_hash in hashes:
                entry = provisional.get(block_hash)
                if entry is not None and entry[1] <= now:
                    del provisional[block_hash]

    # -- queries ---------------------------------------------------------------------------

    @property
    def confirmed_blocks(self) -> int:
        """Distinct block hashes some worker has confirmed holding."""
        return len(self._confirmed)

    def workers(self) -> set[str]:
        return {w for w, held in self._by_worker.items() if held}

    def blocks_of(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def prefix_lengths(
        self, hashes: Sequence[BlockHash], candidates: Iterable[str], now: float,
        host_blocks: dict[str, int] | None = None,
    ) -> dict[str, int]:
        """For each candidate, how many leading blocks of ``hashes`` it holds (confirmed in
        either tier, or provisional). Engines reuse a prefix only up to the first missing block.
        ``host_blocks``, if given, gets for each candidate how many of its leading blocks only its
        host-memory tier holds."""
        if host_blocks is not None:
            host_blocks.update(dict.fromkeys(candidates, 0))
        lengths: dict[str, int] = {}
        alive = 0
        for worker_id in candidates:
            lengths[worker_id] = 0
            bit = self._bit_of.get(worker_id)
            if bit is not None:
                alive |= bit
        if not alive:
            return lengths
        confirmed, provisional, host = self._confirmed, self._provisional, self._host
        depth = 0
        for depth, block_hash in enumerate(hashes):  # noqa: B007 - depth is read after the loop
            held = confirmed.get(block_hash, 0)
            entry = provisional.get(block_hash)
            if entry is not None and entry[1] > now:
                held |= entry[0]
            host_only = alive & host.get(block_hash, 0) & ~held
            if host_only and host_blocks is not None:
                self._count(host_blocks, host_only)
            held |= host_only
            survivors = alive & held
            if survivors != alive:
                self._assign(lengths, alive & ~survivors, depth)
                alive = survivors
                if not alive:
                    return lengths
        else:
            depth = len(hashes)
        self._assign(lengths, alive, depth)
        return lengths

    # -- internals -------------------------------------------------------------------------

    def _assign(self, lengths: dict[str, int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            lengths[self._worker_of[low]] = depth
            mask ^= low

    def _count(self, counts: dict[str, int], mask: int) -> None:
        while mask:
            low = mask & -mask
            counts[self._worker_of[low]] += 1
            mask ^= low

    def _bit(self, worker_id: str) -> int:
        bit = self._bit_of.get(worker_id)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bit_of)
            self._bit_of[worker_id] = bit
            self._worker_of[bit] = worker_id
        return bit

    def _clear_confirmed(self, worker_id: str) -> None:
        bit = self._bit_of.get(worker_id)
        if bit is None:
            return
        for confirmed, by_worker in ((self._confirmed, self._by_worker),
                                     (self._host, self._host_by_worker)):
            held = by_worker.get(worker_id)
            if not held:
                continue
            for block_hash in held:
                _unset_bit(confirmed, block_hash, bit)
            held.clear()

    def _unset(self, block_hash: BlockHash, bit: int) -> None:
        _unset_bit(self._confirmed, block_hash, bit)
        self._unset_provisional(block_hash, bit)

    def _unset_provisional(self, block_hash: BlockHash, bit: int) -> None:
        entry = self._provisional.get(block_hash)
        if entry is not None:
            mask = entry[0] & ~bit
            if mask:
                self._provisional[block_hash] = (mask, entry[1])
            else:
                del self._provisional[block_hash]


def _unset_bit(masks: dict[BlockHash, int], block_hash: BlockHash, bit: int) -> None:
    mask = masks.get(block_hash, 0) & ~bit
    if mask:
        masks[block_hash] = mask
    else:
        masks.pop(block_hash, None)


class EventOrder:
    """Applies each worker's numbered events in order (see router/forwarder.py).

    An ``AllBlocksCleared`` starts a snapshot: it is always taken and resets the worker's
    expected number (older numbers arriving later are stale and dropped). An event ahead of the
    expected number waits (reports can arrive out of order) until the missing ones come; if they
    have not come within ``hold_s`` (or too many wait), they were lost: the worker is out of sync,
    its events are dropped until its next snapshot, and ``expire`` names it so that the caller
    asks for one. Unnumbered events are taken as they come.
    """

    def __init__(self, hold_s: float = 2.0, max_waiting: int = 100_000) -> None:
        self.hold_s = hold_s
        self.max_waiting = max_waiting
        self._next: dict[str, int] = {}  # worker -> number expected next; absent: out of sync
        self._ahead: dict[str, dict[int, KVEvent]] = {}  # events past a hole, by number
        self._hole_since: dict[str, float] = {}
        self.gaps = 0

    def accept(self, worker_id: str, event: KVEvent, seq: int | None, now: float
               ) -> list[KVEvent]:
        """The events to apply now, in order (this one and any it unblocked)."""
        if seq is None:
            return [event]
        if isinstance(event, AllBlocksCleared):
            self._resume(worker_id, seq + 1)
            return [event, *self._drain(worker_id)]
        expected = self._next.get(worker_id)
        if expected is None or seq < expected:  # out of sync, or stale
            return []
        if seq > expected:
            ahead = self._ahead.setdefault(worker_id, {})
            ahead[seq] = event
            self._hole_since.setdefault(worker_id, now)
            if len(ahead) > self.max_waiting:
                self._lose(worker_id)
            return []
        self._next[worker_id] = seq + 1
        return [event, *self._drain(worker_id)]

    def expire(self, now: float) -> list[str]:
        """Workers whose missing events did not come within ``hold_s``: now out of sync."""
        lost = [w for w, since in self._hole_since.items() if now - since >= self.hold_s]
        for worker_id in lost:
            self._lose(worker_id)
        return lost

    def in_sync(self, worker_id: str) -> bool:
        return worker_id in self._next

    def forget(self, worker_id: str) -> None:
        self._next.pop(worker_id, None)
        self._ahead.pop(worker_id, None)
        self._hole_since.pop(worker_id, None)

    def clear(self) -> None:
        self._next.clear()
        self._ahead.clear()
        self._hole_since.clear()

    def _resume(self, worker_id: str, expected: int) -> None:
        self._next[worker_id] = expected
        ahead = self._ahead.get(worker_id)
        if ahead:
            for seq in [s for s in ahead if s < expected]:
                del ahead[seq]

    def _drain(self, worker_id: str) -> list[KVEvent]:
        ahead = self._ahead.get(worker_id)
        if not ahead:
            self._hole_since.pop(worker_id, None)
            return []
        expected = self._next[worker_id]
        ready = []
        while expected in ahead:
            ready.append(ahead.pop(expected))
            expected += 1
        self._next[worker_id] = expected
        if not ahead:
            del self._ahead[worker_id]
            self._hole_since.pop(worker_id, None)
        return ready

    def _lose(self, worker_id: str) -> None:
        expected = self._next.pop(worker_id, None)
        self._ahead.pop(worker_id, None)
        self._hole_since.pop(worker_id, None)
        self.gaps += 1
        log.warning("worker %s: KV events from %s on were lost; dropping its events until a "
                    "snapshot", worker_id, expected)
