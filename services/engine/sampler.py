"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from services.engine.sampling_params import SamplingParams
from services.engine.sequence import TokenLogprobs
from services.engine.speculative.acceptance import (
    AcceptanceRule,
    accept_greedy,
    rejection_sample,
)


class Sampler:
    def __init__(self, seed: int = 0, acceptance_rule: AcceptanceRule = rejection_sample,
                 stream: int = 0) -> None:
        """``stream`` separates samplers that see the same seeded requests: a draft model's
        random draws must be independent of the target's acceptance draws."""
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}
        self._stream = stream
        self.acceptance_rule = acceptance_rule

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._per_request.get(request_id)
        if gen is None:
            seed = (params.seed + self._stream * 0x9E3779B97F4A7C15) % 2**63
            gen = self._per_request[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """One token per row of float32 ``logits`` [N, vocab]."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if not p.greedy:
                # Seeded generators live on the CPU, so a row is sampled there.
                probs = probabilities(logits[row].cpu(), p)
                gen = self._generator(request_id, p)
                tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens

    def draw(self, logits: torch.Tensor, request_id: str, params: SamplingParams
             ) -> tuple[int, torch.Tensor | None]:
        """One token from one row of logits, with the distribution it came from (None when
        greedy: the argmax)."""
        if params.greedy:
            return int(logits.argmax()), None
        probs = probabilities(logits.cpu(), params)
        gen = self._generator(request_id, params)
        return int(torch.multinomial(probs, 1, generator=gen)), probs

    def verify(self, logits: torch.Tensor, request_id: str, params: SamplingParams,
               draft_tokens: list[int], draft_probs: torch.Tensor | None) -> list[int]:
        """The tokens a step emits for a sequence that verified ``draft_tokens``: the accepted
        drafts, then one from the target. ``logits`` has one row more than the drafts."""
        if params.greedy:
            return accept_greedy(logits.argmax(dim=-1).tolist(), draft_tokens)
        target = torch.stack([probabilities(row, params) for row in logits.cpu()])
        return self.acceptance_rule(target, draft_tokens, draft_probs,
                                    self._generator(request_id, params))


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, top-p."""
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the best always stays.
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
        drop[0] = False  # even a top_p that rounds to 0 in float32 (5e-324)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    return scaled.softmax(-1)


def token_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """Logprobs of the model's raw distribution (before temperature and truncation)."""
    logprobs = logits.log_softmax(-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = logprobs.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id, float(logprobs[token_id]), top)
