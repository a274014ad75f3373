"""What the router decided, and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

# Reasons
PREFIX: Final = "prefix"  # the chosen prefill worker holds the longest cached prefix
# load decided: no cached prefix anywhere, or a longer one sits on a busier worker
LOAD: Final = "load"
FALLBACK: Final = "fallback"  # no usable index: rendezvous hashing of the first blocks
SKIP_PREFILL: Final = "skip_prefill"  # decode computes the prompt itself
ROUND_ROBIN: Final = "round_robin"  # policy round_robin: the prefill workers' turn

# Details for SKIP_PREFILL and FALLBACK
SHORT_PROMPT: Final = "short_prompt"
CACHED_ON_DECODE: Final = "cached_on_decode"
NO_PREFILL_WORKERS: Final = "no_prefill_workers"
BUS_UNAVAILABLE: Final = "bus_unavailable"
INDEX_REBUILDING: Final = "index_rebuilding"
INDEX_EMPTY: Final = "index_empty"


@dataclass(frozen=True)
class RoutingDecision:
    request_id: str
    prefill_worker: str | None  # None when prefill is skipped
    decode_worker: str | None  # None when no decode worker is registered
    reason: str
    detail: str
    prompt_tokens: int
    prompt_blocks: int  # blocks the prompt occupies, a trailing partial block included
    cached_blocks: int  # leading blocks cached on the worker that computes the prompt
    prefill_address: str | None = None
    decode_address: str | None = None
    # Prefill candidates' costs (lower wins) or, for the fallback, rendezvous weights (higher wins).
    prefill_scores: Mapping[str, float] = field(default_factory=dict)
    # Decode candidates' load scores (lower wins).
    decode_scores: Mapping[str, float] = field(default_factory=dict)

    @property
    def skip_prefill(self) -> bool:
        return self.prefill_worker is None
