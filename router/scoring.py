"""Scoring rules: prefill by cache affinity against load, decode by power of two choices."""

from __future__ import annotations

import random
from collections.abc import Mapping

from tandem.router.rendezvous import rendezvous_choose

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
