"""Scoring rules: prefill by cache affinity against load, decode by power of two choices."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence

from tandem.services.protocol.block_hash import BlockHash, hash_block

_TIE = 1e-9


def prefill_cost(
    prompt_blocks: int, cached_blocks: int, pending_blocks: float, miss_weight: float,
    load_weight: float, host_blocks: int = 0, host_hit_cost: float = 0.0,
) -> float:
    """``cached_blocks`` leading blocks are reused, ``host_blocks`` of them copied back from
    host memory at ``host_hit_cost`` of a miss each (a device hit costs nothing)."""
    uncached = prompt_blocks - cached_blocks + host_hit_cost * host_blocks
    return miss_weight * uncached + load_weight * pending_blocks


def decode_score(
    kv_usage: float, running_sequences: float, kv_weight: float, running_weight: float
) -> float:
    return kv_weight * kv_usage + running_weight * running_sequences


def lowest(scores: Mapping[str, float], tie_key: bytes) -> str:
    """Lowest score wins; ties go to the rendezvous winner for ``tie_key``, so every replica
    breaks a tie the same way while different prompts still spread across the tied workers."""
    best = min(scores.values())
    return rendezvous_choose(tie_key, (w for w, s in scores.items() if s <= best + _TIE))


def power_of_two(scores: Mapping[str, float], rng: random.Random) -> str:
    """Sample two candidates, keep the less loaded: near-best balance without herding every
    router onto the single least-loaded worker between heartbeats."""
    ids = sorted(scores)
    if len(ids) == 1:
        return ids[0]
    a, b = rng.sample(ids, 2)  # random order, so a tie goes to a random one of the two
    return a if scores[a] <= scores[b] else b


# -- Rendezvous hashing ------------------------------------------------------------------------
# Rendezvous (highest-random-weight) hashing: the fallback when no index can be trusted. Every
# router replica, given the same key and workers, picks the same worker, and removing one worker
# only moves the keys it owned.


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
