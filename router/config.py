"""Router settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tandem.services.protocol.block_hash import HashSettings

# Routing policies. prefix: cache affinity weighed against load (what the rest of these options
# tune). round_robin: prefill workers in turn, blind to caches and load (the baseline prefix-aware
# routing is measured against); decode is chosen by load under both.
PREFIX_AWARE: Final = "prefix"
ROUND_ROBIN: Final = "round_robin"
POLICIES: Final = (PREFIX_AWARE, ROUND_ROBIN)


@dataclass(frozen=True)
class RouterConfig:
    settings: HashSettings
    policy: str = PREFIX_AWARE
    # Prefill cost = miss_weight * uncached prompt blocks + load_weight * pending prefill blocks.
    # With both at 1 the cost is the blocks a worker must compute before this prompt is done.
    miss_weight: float = 1.0
    load_weight: float = 1.0
    # A prompt block a worker holds only in its host-memory KV tier costs this fraction of a
    # miss (copied back, not recomputed): between a device hit (0) and a miss (1).
    host_hit_cost: float = 0.25
    # Prompts shorter than this many tokens skip prefill (decode computes them); 0 disables.
    short_prompt_tokens: int = 0
    # A prompt whose full blocks are all cached on a decode worker, but for at most this many
    # tokens, goes straight to it (it computes the rest: a session's next turn skips the
    # prefill worker and the transfer; Dynamo's max_local_prefill_length); 0: all of them.
    # 256 halved the agent benchmark's turn-2+ TTFT on 1P+2D (docs/loadtest.md).
    max_local_prefill_tokens: int = 0
    skip_prefill_when_cached_on_decode: bool = True  # False: never for a cached prompt
    # Decode score = kv_weight * KV usage (0..1) + running_weight * running sequences.
    decode_kv_weight: float = 1.0
    decode_running_weight: float = 0.01
    provisional_ttl_s: float = 2.0
    # Leading blocks that key the rendezvous fallback (and break cost ties).
    fallback_prefix_blocks: int = 4
    inflight_max_age_s: float = 30.0
    # A lapsed worker's index entries are dropped after this long without a heartbeat.
    forget_lapsed_after_s: float = 60.0
    # Sessions (router/sessions.py): a session stays on its decode worker while that worker's
    # decode score is within session_slack of the lowest; idle sessions are forgotten after
    # session_ttl_s; at most max_sessions are kept.
    session_slack: float = 0.25
    session_ttl_s: float = 600.0
    max_sessions: int = 100_000
    # Seeds the decode power-of-two sampling.
    seed: int = 0
    memo_blocks: int = 1 << 17

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.policy!r}")
        if self.miss_weight < 0 or self.load_weight < 0:
            raise ValueError("weights must be >= 0")
        if not 0 <= self.host_hit_cost <= 1:
            raise ValueError(f"host_hit_cost must be in [0, 1], got {self.host_hit_cost}")
        if self.session_slack < 0 or not self.session_ttl_s > 0 or self.max_sessions < 1:
            raise ValueError("session_slack must be >= 0, session_ttl_s > 0, max_sessions >= 1")
        if self.fallback_prefix_blocks < 1:
            raise ValueError("fallback_prefix_blocks must be >= 1")
