"""Chained KV block hashes shared by workers and the router.

A block's hash is SHA-256 over a canonical byte encoding of (parent hash, the block's token ids,
extra keys such as the model id, the KV cache dtype when not ``auto`` and the per-tenant cache
salt). Never Python's ``hash()``: it
differs per process. This module imports nothing heavy so the router can use it without torch.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
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
