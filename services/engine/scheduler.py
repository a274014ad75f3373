"""Iteration-level scheduler: continuous batching with chunked prefill.

Each step spends a token budget: running sequences first, decoding ones before prefilling ones
(one decode token each, plus any speculative draft tokens to verify; then the next chunk of each
unfinished prompt), then waiting prompts. A long prompt is cut to what is left of the budget, so
it never holds up running sequences for more than one chunk, and a prompt's chunk never takes
the budget from a sequence that is decoding. When blocks run out, the last running sequence in
that order is preempted: its blocks are freed and it is recomputed later (its full blocks
usually come back from the prefix cache).

Tenants share a step fairly (``Sequence.tenant``, from the request's API key): unfinished
prompts take the budget, and waiting prompts are admitted, in order of how many sequences their
tenant is running (fewest first; arrival order among equals). A tenant flooding the engine thus
cannot queue another tenant's prompt behind its own: the other's next prompt is the first
chunk of the next step. With one tenant this is plain arrival order.

The scheduler owns request state: it knows every request the engine holds (``requests``), makes
every status change (``SequenceStatus`` draws the transitions), and is the one writer of a
sequence's ``num_computed_tokens``. The engine asks it by request id and calls its transitions.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from tandem.services.engine.block_manager import BlockManager
from tandem.services.engine.sequence import Sequence, SequenceStatus


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
        self.requests: dict[str, Sequence] = {}  # every unfinished request, in any status
        self.waiting: deque[Sequence] = deque()  # WAITING and WAITING_WITH_KV, in order
        self.running: list[Sequence] = []
        self._num_by_status: Counter[SequenceStatus] = Counter()

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def num_with_status(self, status: SequenceStatus) -> int:
        return self._num_by_status[status]

    def has_work(self) -> bool:
        """Whether a step has anything to schedule (importing and pinned requests do not)."""
        return bool(self.waiting or self.running)

    # -- transitions ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new request: queue its prompt."""
        self._register(seq, SequenceStatus.WAITING)
        self.waiting.append(seq)

    def begin_import(self, seq: Sequence) -> int | None:
        """Reserve blocks for the prompt of ``seq``, whose KV a transfer will fill; leading
        blocks this engine caches are reused. Returns how many, or None (nothing changed) when
        the rest are not free now."""
        bm = self.block_manager
        cached = bm.find_cached_prefix(seq)
        num_new = seq.num_prompt_tokens - len(cached) * bm.block_size
        if not bm.can_admit(seq, cached, num_new):
            return None
        self._admit(seq, cached, num_new)
        self._register(seq, SequenceStatus.WAITING_FOR_REMOTE_KV)
        return len(cached)

    def commit_import(self, seq: Sequence) -> None:
        """The transfer filled the blocks: the prompt is computed; queue it to decode."""
        assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        self._set_status(seq, SequenceStatus.WAITING_WITH_KV)
        self.waiting.append(seq)

    def recompute_import(self, seq: Sequence) -> None:
        """The transfer failed: drop the reserved blocks and queue the prompt to prefill."""
        assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV
        self._free(seq)
        self._set_status(seq, SequenceStatus.WAITING)
        self.waiting.append(seq)

    def computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """After a step: the first ``num_computed_tokens`` tokens of ``seq`` have their KV in
        the cache. Frees tail blocks past its tokens (they held rejected draft tokens) and
        offers newly full blocks to the prefix cache."""
        seq.num_computed_tokens = num_computed_tokens
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.cache_full_blocks(seq)

    def pin(self, seq: Sequence) -> None:
        """A prefill-only request is done: stop scheduling it but keep its blocks."""
        assert seq.status is SequenceStatus.RUNNING
        self.running.remove(seq)
        self._set_status(seq, SequenceStatus.PINNED)

    def finish(self, seq: Sequence) -> None:
        """A request finished, was aborted or released its pinned KV: drop it from wherever it
        is and free its blocks (full ones stay in the prefix cache)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.WAITING_WITH_KV):
            self.waiting.remove(seq)
        self._free(seq)
        self._set_status(seq, SequenceStatus.FINISHED)
        del self.requests[seq.request_id]

    # -- scheduling -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        share = Counter(seq.tenant for seq in self.running)
        # Decoding sequences first, then prompts by their tenant's share (a stable sort: arrival
        # order among equals). Preemption takes its victims from the end of this order, which
        # this step has not scheduled yet (admissions join ``running`` after the loop).
        self.running.sort(key=lambda seq: (1, share[seq.tenant]) if _prefilling(seq) else (0, 0))
        budget = self.max_num_batched_tokens
        prompts: deque[Sequence] = deque()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if _prefilling(seq):
                prompts.append(seq)
            elif budget > 0:
                budget = self._schedule_running(seq, budget, out)

        # Prompts: running ones' next chunks and waiting ones, the tenant running fewer first
        # (running before waiting among equals). No admission once a step had to preempt, or
        # once the chosen waiting prompt finds no room (it is not passed over).
        admitted: list[Sequence] = []
        admitting = True
        while budget > 0:
            while prompts and prompts[0].status is not SequenceStatus.RUNNING:
                prompts.popleft()  # preempted by an earlier chunk of this step
            admitting = (admitting and not out.preempted and bool(self.waiting)
                         and len(self.running) + len(admitted) < self.max_num_seqs)
            waiting = min(self.waiting, key=lambda s: share[s.tenant]) if admitting else None
            if prompts and (waiting is None or share[prompts[0].tenant] <= share[waiting.tenant]):
                budget = self._schedule_running(prompts.popleft(), budget, out)
            elif waiting is not None:
                num_new = self._admit_waiting(waiting, budget)
                if num_new == 0:
                    admitting = False
                    continue
                share[waiting.tenant] += 1
                admitted.append(waiting)
                out.scheduled.append(ScheduledSequence(waiting, num_new))
                budget -= num_new
            else:
                break
        self.running.extend(admitted)
        return out

    def _schedule_running(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule a running sequence's next tokens (preempting from the end of ``running``
        until its blocks fit, itself last); returns the budget left."""
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
                return budget
        out.scheduled.append(ScheduledSequence(seq, num_new))
        return budget - num_new

    def _admit_waiting(self, seq: Sequence, budget: int) -> int:
        """Move a waiting prompt to running with blocks for its first chunk; returns the
        chunk's tokens, or 0 (nothing changed) when its blocks are not free."""
        if seq.status is SequenceStatus.WAITING_WITH_KV:  # holds its prompt's blocks
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, num_new):
                return 0
        else:
            cached = self.block_manager.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.block_size, budget)
            if not self.block_manager.can_admit(seq, cached, num_new):
                return 0
            self._admit(seq, cached, num_new)
        self.waiting.remove(seq)
        self._set_status(seq, SequenceStatus.RUNNING)
        return num_new

    # -- internals ------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def _register(self, seq: Sequence, status: SequenceStatus) -> None:
        assert seq.request_id not in self.requests, "the engine checks ids are free"
        self.requests[seq.request_id] = seq
        seq.status = status
        self._num_by_status[status] += 1

    def _set_status(self, seq: Sequence, status: SequenceStatus) -> None:
        self._num_by_status[seq.status] -= 1
        self._num_by_status[status] += 1
        seq.status = status

    def _admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Give ``seq`` its cached prefix blocks, then blocks for ``num_new_tokens`` more."""
        self.block_manager.admit(seq, cached)
        seq.num_computed_tokens = seq.num_cached_tokens
        allocated = self.block_manager.allocate(seq, num_new_tokens)
        assert allocated, "can_admit promised room"

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.spec_token_ids.clear()
        self._set_status(seq, SequenceStatus.WAITING)
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)


def _prefilling(seq: Sequence) -> bool:
    """Whether its prompt is not computed yet (a decoding sequence has one token to compute)."""
    return seq.num_tokens - seq.num_computed_tokens > 1
