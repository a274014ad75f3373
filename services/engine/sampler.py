"""Token sampling: greedy, temperature, top-k, top-p, logprobs, with draws keyed by position.

A sampled request's token at output position ``i`` is ``argmax(probs / E)``, where ``E`` holds
one Exp(1) variate per vocabulary entry drawn from a generator seeded by ``(seed, i)`` alone:
the exponential race, which picks token x with probability ``probs[x]``. The draw depends on
nothing else (not the batch, the worker, the step, nor what came before), so a request
continues exactly on any worker: colocated, disaggregated, after a migration, and with or
without speculation. Every sampled request has a seed: the client's, or one the gateway (or,
called directly, the engine) chose and recorded in the request.

Speculative decoding verifies drafts by the same rule (``verify``): the target draws its own
token at each drafted position and a draft is accepted while it equals that draw, so the
emitted tokens are exactly those plain decoding emits. A draft model drafts with the same
noise (``sample`` at the same positions), so where it is close to the target its draws agree.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from services.engine.sampling_params import SamplingParams
from services.engine.sequence import TokenLogprobs

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a request's draw at output ``position`` (SplitMix64 of both)."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def exponential_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Exp(1) variates, one per vocabulary entry, for the draw at ``position`` (CPU)."""
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    noise = torch.empty(vocab_size).exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # never 0 (then 0/0 = NaN)


def sample(logits: torch.Tensor, params: Seq[SamplingParams], positions: Seq[int]
           ) -> list[int]:
    """One token per row of float32 ``logits`` [N, vocab]: row i is a draw of ``params[i]``'s
    request at output position ``positions[i]``."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, position) in enumerate(zip(params, positions, strict=True)):
        if not p.greedy:
            if p.seed is None:
                raise ValueError("a sampled request needs a seed (the engine assigns one)")
            probs = probabilities(logits[row].float().cpu(), p)
            noise = exponential_noise(p.seed, position, probs.shape[-1])
            tokens[row] = int((probs / noise).argmax())
    return tokens


def verify(logits: torch.Tensor, params: SamplingParams, first_position: int,
           draft_tokens: list[int]) -> list[int]:
    """The tokens a step emits for a sequence that verified ``draft_tokens`` at output
    positions ``first_position``...: the drafts that equal the target's own draws, then the
    target's draw at the first mismatch (or after the last draft). ``logits`` has one row
    more than the drafts."""
    rows = len(draft_tokens) + 1
    targets = sample(logits[:rows], [params] * rows, range(first_position, first_position + rows))
    return accept_matching(targets, draft_tokens)


def accept_matching(targets: list[int], draft_tokens: list[int]) -> list[int]:
    """``targets[i]`` is the target's token after draft i (row 0: before any)."""
    emitted: list[int] = []
    for i, draft in enumerate(draft_tokens):
        emitted.append(targets[i])
        if targets[i] != draft:
            return emitted
    emitted.append(targets[len(draft_tokens)])
    return emitted


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
