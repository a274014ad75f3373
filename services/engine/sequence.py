"""A request's state inside the engine."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.services.protocol.block_hash import BlockHash
from tandem.services.protocol.outputs import FinishReason, TokenLogprobs
from tandem.services.protocol.request import DEFAULT_TENANT, SamplingParams


class SequenceFault(RuntimeError):
    """A step failed in one sequence's own work, before any sequence's state changed (an
    injected fault naming it; see services/engine/faults.py): only that request fails, and the
    step's other requests run again in the next step, exactly."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class SequenceStatus(enum.Enum):
    """Where a request is; only the scheduler changes it (see ``Scheduler``).

    add ──▶ WAITING ──▶ RUNNING ──▶ FINISHED           (preemption: RUNNING ──▶ WAITING)
                            └──▶ PINNED ──▶ FINISHED   (prefill-only, until release_kv)
    begin_import ──▶ WAITING_FOR_REMOTE_KV ──▶ WAITING_WITH_KV ──▶ RUNNING   (commit_import)
                                         └──▶ WAITING                        (recompute_import)
    Aborting frees the blocks from any status.
    """

    WAITING = "waiting"  # queued; holds no blocks until admitted
    WAITING_WITH_KV = "waiting_with_kv"  # queued holding its prompt's KV (a committed import)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, a transfer fills them
    RUNNING = "running"
    PINNED = "pinned"  # prefill done; its KV is held for a transfer until release_kv
    FINISHED = "finished"


_uids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    extra_keys: tuple[str, ...]  # block-hash extra keys: model id and cache salt
    tenant: str = DEFAULT_TENANT  # whose request: the scheduler shares a step among tenants
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, in order
    # Tokens whose k/v sit in the cache. The scheduler alone writes it for the engine's
    # sequences; a draft proposer's shadow sequences keep their own (speculative/draft.py).
    num_computed_tokens: int = 0
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # sampling.prompt_logprobs: entry i is prompt token i + 1's, given the tokens before it
    # (filled as prefill chunks run; handed out once, with the first output).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    prefill_only: bool = False  # prefill role: stop after the first token and pin the prompt KV
    # Speculative draft tokens for this step, verified after the last real token; never part
    # of token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured output: the llguidance matcher fed the output so far (engine/grammar.py).
    matcher: Any = None
    uid: int = field(default_factory=_uids.__next__)  # unique in this process

    @property
    def kv_key(self) -> tuple[int, int]:
        """Names this sequence's KV as computed: a preempted one recomputes it anew."""
        return self.uid, self.num_preemptions

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions whose logits the prompt's logprobs still need (each predicts the next
        prompt token); empty unless the request asked for them."""
        if self.sampling.prompt_logprobs is None or self.prompt_logprobs_sent:
            return range(0)
        return range(len(self.prompt_logprobs), self.num_prompt_tokens - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
