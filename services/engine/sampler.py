"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from services.engine.sampling_params import SamplingParams
from services.engine.sequence import TokenLogprobs


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = self._per_request[request_id] = torch.Generator().manual_seed(params.seed)
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
