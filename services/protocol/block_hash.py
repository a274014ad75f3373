"""Chained KV block hashes shared by workers and the router.

A block's hash is SHA-256 over a canonical byte encoding of (parent hash, the block's token ids,
extra keys such as the model id, the KV cache dtype when not ``auto`` and the per-tenant cache
salt). Never Python's ``hash()``: it
differs per process. This module imports nothing heavy so the router can use it without torch.

``PromptHasher`` is the router's: the same hashes with a memo of recent prefixes.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

HASH_SCHEME = "sha256-v1"
_DOMAIN = b"tandem-kv-block\x00" + HASH_SCHEME.encode()
_ROOT_PARENT = b"\x00" * 32
_BASE = hashlib.sha256(_DOMAIN)
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
assert array(_TOKEN_TYPECODE).itemsize == 4

BlockHash = bytes


@dataclass(frozen=True)
class HashSettings:
    """Everything that must agree between router and workers for hashes to match."""

    block_size: int
    model_id: str
    scheme: str = HASH_SCHEME
    # What a block's bytes hold (engine config kv_cache_dtype): an int8 worker's blocks never
    # match an auto worker's. ``auto`` adds no key, so those hashes are as before.
    kv_cache_dtype: str = "auto"

    def extra_keys(self, cache_salt: str | None = None) -> tuple[str, ...]:
        keys = (self.model_id,)
        if self.kv_cache_dtype != "auto":
            keys += (f"kv:{self.kv_cache_dtype}",)
        return keys + (cache_salt,) if cache_salt else keys


def _encode_extra_key(key: str | int | bytes) -> bytes:
    if isinstance(key, bytes):
        tag, raw = b"b", key
    elif isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"extra hash key must be str, int or bytes, got {type(key).__name__}")
    elif isinstance(key, int):
        tag, raw = b"i", str(key).encode()
    else:
        tag, raw = b"s", key.encode()
    return tag + struct.pack("<I", len(raw)) + raw


@lru_cache(maxsize=4096)
def _encode_extra_keys(keys: tuple[str | int | bytes, ...]) -> bytes:
    return struct.pack("<I", len(keys)) + b"".join(_encode_extra_key(k) for k in keys)


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int | bytes] = (),
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    tokens = array(_TOKEN_TYPECODE, token_ids)  # u32; rejects negative or oversized ids
    if sys.byteorder == "big":
        tokens.byteswap()
    h = _BASE.copy()
    h.update(parent if parent is not None else _ROOT_PARENT)
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens)
    h.update(_encode_extra_keys(tuple(extra_keys)))
    return h.digest()


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str | int | bytes] = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


_ITEM = array(_TOKEN_TYPECODE).itemsize  # token ids pack like the engine's "<I": 0 .. 2**32 - 1


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
            packed = array(_TOKEN_TYPECODE, token_ids).tobytes()
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
