"""Deciding which draft tokens the target accepts.

Greedy: accept while the target's argmax agrees, then emit the target's own token. Sampling: the
standard rejection scheme (Leviathan et al. 2023; Chen et al. 2023): accept draft token x with
probability min(1, p(x) / q(x)); on the first rejection sample from the normalised residual
max(0, p - q); if all are accepted, sample one bonus token from p. The emitted tokens are then
distributed exactly as if the target had sampled them one at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (target probs [k+1, V], draft tokens [k], draft probs [k, V] or None for a point mass,
#  generator) -> emitted tokens: the accepted drafts, then one token from the target.
AcceptanceRule = Callable[[torch.Tensor, list[int], torch.Tensor | None, torch.Generator],
                          list[int]]


def accept_greedy(target_argmax: list[int], draft_tokens: list[int]) -> list[int]:
    """``target_argmax[i]`` is the target's choice after draft token i (row 0: before any)."""
    emitted: list[int] = []
    for i, draft in enumerate(draft_tokens):
        emitted.append(target_argmax[i])
        if target_argmax[i] != draft:
            return emitted
    emitted.append(target_argmax[len(draft_tokens)])
    return emitted


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int],
                     draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    emitted: list[int] = []
    for i, draft in enumerate(draft_tokens):
        p = target_probs[i]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        if float(torch.rand((), generator=generator)) * q_draft < float(p[draft]):
            emitted.append(draft)  # u < p/q, written without dividing by a tiny q
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        # A rejection means p(x) < q(x), so p has mass elsewhere; the guard covers rounding.
        dist = residual / total if total > 0 else p
        emitted.append(int(torch.multinomial(dist, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1,
                                         generator=generator)))
    return emitted
