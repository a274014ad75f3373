"""Rendezvous (highest-random-weight) hashing: the fallback when no index can be trusted.

Every router replica, given the same key and workers, picks the same worker, and removing one
worker only moves the keys it owned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from tandem.services.protocol.block_hash import BlockHash, hash_block

_SCALE = float(1 << 64)


def rendezvous_key(
    hashes: Sequence[BlockHash],
    prefix_blocks: int,
    token_ids: Sequence[int] = (),
    extra_keys: Sequence[str] = (),
) -> bytes:
    """The key of a prompt: the chained hash of its first ``prefix_blocks`` blocks (which covers
    all of them), or, for a prompt shorter than one block, a hash of its tokens."""
    if hashes:
        return hashes[min(prefix_blocks, len(hashes)) - 1]
    return hash_block(None, token_ids, extra_keys)


def rendezvous_weight(key: bytes, worker_id: str) -> float:
    """Pseudo-random weight in [0, 1) of ``worker_id`` for ``key``, identical in every process."""
    digest = hashlib.blake2b(key + b"\x00" + worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE


def rendezvous_choose(key: bytes, workers: Iterable[str]) -> str:
    """The worker with the highest weight for ``key``; ``workers`` must not be empty."""
    return max(workers, key=lambda w: (rendezvous_weight(key, w), w))
