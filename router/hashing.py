"""Prompt block hashes, computed with the engine's own function so they match the workers'."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tandem.services.protocol.block_hash import BlockHash, HashSettings, hash_block

_ITEM = array("I").itemsize  # token ids pack like the engine's "<I": 0 .. 2**32 - 1


class PromptHasher:
    """Chained block hashes of a prompt, equal to ``hash_token_blocks`` with the engine's keys.

    A bounded memo of (parent hash, block tokens) -> hash skips SHA-256 for prefixes seen
    recently (shared system prompts), which is most of the work for long prompts. A miss calls
    the engine's ``hash_block``, so the result is identical to ``hash_token_blocks`` either way.
    Memo keys are flat bytes (parent + packed tokens): one object per entry, cheap to drop.
    """

    def __init__(self, settings: HashSettings, memo_blocks: int = 1 << 17) -> None:
        if settings.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {settings.block_size}")
        self.settings = settings
        self.memo_blocks = max(memo_blocks, 0)
        # LRU rather than generations: evicting one entry per insert keeps latency flat, where
        # dropping a whole generation at once costs a millisecond in the unlucky request.
        self._memo: OrderedDict[bytes, BlockHash] = OrderedDict()
        self._roots: dict[tuple[str, ...], bytes] = {}
        self._lock = threading.Lock()

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks the prompt occupies, the trailing partial block included."""
        return -(-num_tokens // self.settings.block_size)

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids`` (a trailing partial block is skipped)."""
        extra = self.settings.extra_keys(cache_salt)
        if self.memo_blocks == 0:
            return self._hash_all(token_ids, extra)
        try:
            packed = array("I", token_ids).tobytes()
        except (OverflowError, TypeError):
            return self._hash_all(token_ids, extra)  # let the engine's function judge them
        with self._lock:
            return self._hash_memo(token_ids, packed, extra)

    def _hash_memo(
        self, token_ids: Sequence[int], packed: bytes, extra: tuple[str, ...]
    ) -> list[BlockHash]:
        bs = self.settings.block_size
        width = bs * _ITEM
        # The first block has no parent: a digest of the extra keys stands in for it (every
        # later parent hash already covers them).
        parent_key = self._root(extra)
        parent: BlockHash | None = None
        out: list[BlockHash] = []
        memo = self._memo
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = parent_key + packed[start * _ITEM : start * _ITEM + width]
            digest = memo.get(key)
            if digest is None:
                digest = hash_block(parent, token_ids[start : start + bs], extra)
                memo[key] = digest
                if len(memo) > self.memo_blocks:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(key)
            out.append(digest)
            parent = digest
            parent_key = digest
        return out

    def _root(self, extra: tuple[str, ...]) -> bytes:
        root = self._roots.get(extra)
        if root is None:
            if len(self._roots) > 10_000:
                self._roots.clear()
            # 33 bytes cannot collide with a 32-byte parent digest.
            root = b"\x00" + hash_block(None, (), extra)
            self._roots[extra] = root
        return root

    def _hash_all(self, token_ids: Sequence[int], extra: tuple[str, ...]) -> list[BlockHash]:
        bs = self.settings.block_size
        out: list[BlockHash] = []
        parent: BlockHash | None = None
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash_block(parent, token_ids[start : start + bs], extra)
            out.append(parent)
        return out
