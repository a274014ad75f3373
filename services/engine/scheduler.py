"""Iteration-level scheduler: continuous batching with chunked prefill.

Each step spends a token budget: running sequences first (one decode token each, plus any
speculative draft tokens to verify, or the next chunk of an unfinished prompt), then waiting
prompts in arrival order. A long prompt is cut to what is left of the budget, so it never holds
up running sequences for more than one chunk. When blocks run out, the newest running sequence
is preempted: its blocks are freed and it is recomputed later (its full blocks usually come
back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed for this sequence in the step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_token_ids:  # verify as many draft tokens as the budget allows
                del seq.spec_token_ids[max(0, budget - num_new):]
                num_new += len(seq.spec_token_ids)
            num_new = min(num_new, budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
        if out.preempted:
            return out  # no room to admit anyone this step

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.block_ids:  # imported KV: it already holds its prompt's blocks
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.block_manager.allocate(seq, num_new):
                    break
                self.waiting.popleft()
            else:
                cached = self.block_manager.find_cached_prefix(seq)
                num_new = min(seq.num_tokens - len(cached) * self.block_manager.block_size,
                              budget)
                if not self.block_manager.can_admit(seq, cached, num_new):
                    break
                self.waiting.popleft()
                self.block_manager.admit(seq, cached)
                allocated = self.block_manager.allocate(seq, num_new)
                assert allocated, "can_admit promised room"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        return out

    def finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks (unless the
        caller keeps them, e.g. a prefill pinning its prompt's KV for a transfer)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
