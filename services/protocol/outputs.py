"""What the engine hands out: per-step outputs, stats and its errors. No torch here.

The gateway, the router side of the app and the wire codecs import these without loading the
model's dependencies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top": [list(t) for t in self.top]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenLogprobs:
        return cls(int(data["token_id"]), float(data["logprob"]),
                   [(int(t), float(p)) for t, p in data["top"]])


class RequestError(ValueError):
    """The request is invalid; nothing about the engine changed."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later."""


class EngineError(RuntimeError):
    """The engine failed while running the request (a fault in a step, not in the request);
    the request's blocks were freed and the engine goes on with its other requests."""


class EngineDeadError(EngineError):
    """The engine stopped after a fault it cannot recover from (a device error, repeated step
    failures): its worker is unhealthy and is replaced; send the request elsewhere."""


class UnavailableError(RuntimeError):
    """Nothing can serve the request now (no healthy worker of a role); retry later."""


class DeadlineExceededError(TimeoutError):
    """The request's deadline passed before it finished; it was aborted and its blocks freed."""


@dataclass(frozen=True)
class PinnedKV:
    """A prefill-only request's prompt KV, held in ``block_ids`` until ``release_kv``."""

    request_id: str
    block_ids: tuple[int, ...]  # in prompt order; the last one may be partly filled
    num_tokens: int  # prompt tokens whose k/v the blocks hold


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv: PinnedKV | None = None  # set when a prefill-only request pinned its prompt's KV
    # SamplingParams.prompt_logprobs: with the request's first output (entry i: prompt token
    # i + 1's); None otherwise.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    num_pinned: int = 0  # prefill-only requests holding their KV for a transfer
    num_importing: int = 0  # requests whose KV a transfer is filling
    spec_draft_tokens: int = 0  # draft tokens the target verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_steps: int = 0  # (sequence, step) pairs that verified at least one draft token
    pending_prefill_blocks: int = 0  # prompt blocks of waiting/running requests not computed yet
    # The host-memory KV tier (all 0 when it is off)
    host_kv_restored_blocks: int = 0  # host-tier hits: blocks copied back instead of recomputed
    host_kv_offloaded_blocks: int = 0  # evicted cached blocks copied to host memory
    host_kv_blocks: int = 0  # blocks the pool holds now
    host_kv_capacity_blocks: int = 0
    block_size: int = 0  # tokens per KV block: the cache holds num_blocks x block_size tokens


class DecodeRejectedError(RuntimeError):
    """The decode worker would not take the request (no capacity, shutting down); the
    prefill worker was told to free its blocks. Another decode worker may take it."""


class KVTransferFailedError(RuntimeError):
    """The prompt's KV could not be pulled and the worker is configured not to recompute."""
