"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.engine.block_hash import BlockHash
from services.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    IMPORTING = "importing"  # holds blocks that a KV transfer is filling; not scheduled
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    extra_keys: tuple[str, ...]  # block-hash extra keys: model id and cache salt
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, in order
    num_computed_tokens: int = 0  # tokens whose k/v sit in the cache
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prefill_only: bool = False  # prefill role: stop after the first token and pin the prompt KV
    # Speculative draft tokens for this step, verified after the last real token; never part
    # of token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
