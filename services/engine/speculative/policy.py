"""How many tokens to draft for each sequence this step.

Speculation spends compute on tokens that may be rejected. That is free while a decode step is
bound by reading weights (small batches) and costly once the batch fills the machine, so the
adaptive policy shares a fixed budget of draft tokens per step across the decoding batch (k
shrinks as the batch grows, and speculation stops beyond the budget), and pauses a request whose
recent acceptance rate fell below ``min_acceptance`` (it retries after a while, since text
changes; each failed retry doubles the pause). A new request starts from the engine-wide
acceptance rate, so when the proposer is failing everywhere (an untrained self-draft, n-gram on
open-ended chat) new requests start paused instead of paying for a few rejected steps each.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.engine.config import SpeculativeConfig
from tandem.services.engine.sequence import Sequence

_EMA_WEIGHT = 0.5  # of the newest step in a request's acceptance-rate average
_GLOBAL_EMA_WEIGHT = 0.2  # of the newest step in the engine-wide average
_PAUSE_STEPS = 16  # steps a low-acceptance request decodes plainly before trying again
_MAX_PAUSE_DOUBLINGS = 4  # so a pause lasts at most 256 steps


@dataclass
class _Acceptance:
    rate: float = 1.0  # optimistic until measured
    paused_for: int = 0
    pauses: int = 0  # in a row, without a good step in between


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._acceptance: dict[str, _Acceptance] = {}
        self.global_rate = 1.0  # engine-wide acceptance-rate average; optimistic at start

    def draft_lengths(self, candidates: list[Sequence], batch_size: int) -> dict[str, int]:
        """k for each candidate (absent or 0: decode plainly). ``batch_size`` counts every
        running sequence, prefilling ones included: they share the step."""
        k = self.config.k
        if self.config.adaptive:
            k = min(k, self.config.max_draft_tokens_per_step // max(batch_size, 1))
        lengths = {}
        for seq in candidates:
            if not seq.sampling.speculative:
                continue
            state = self._acceptance.get(seq.request_id) or self._new_state(seq.request_id)
            if state.paused_for:
                state.paused_for -= 1
                continue
            wanted = min(k, seq.sampling.num_speculative_tokens or k)
            if wanted > 0:
                lengths[seq.request_id] = wanted
        return lengths

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if not self.config.adaptive or num_draft == 0:
            return
        state = self._acceptance.get(request_id) or self._new_state(request_id)
        rate = num_accepted / num_draft
        self.global_rate += _GLOBAL_EMA_WEIGHT * (rate - self.global_rate)
        state.rate += _EMA_WEIGHT * (rate - state.rate)
        if state.rate < self.config.min_acceptance:
            state.paused_for = _PAUSE_STEPS << min(state.pauses, _MAX_PAUSE_DOUBLINGS)
            state.pauses += 1
            # One good step after the pause keeps it speculating; one bad step pauses again.
            state.rate = self.config.min_acceptance
        else:
            state.pauses = 0

    def _new_state(self, request_id: str) -> _Acceptance:
        state = self._acceptance[request_id] = _Acceptance(rate=self.global_rate)
        if self.config.adaptive and self.global_rate < self.config.min_acceptance:
            state.paused_for, state.pauses = _PAUSE_STEPS, 1
            state.rate = self.config.min_acceptance
        return state

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
