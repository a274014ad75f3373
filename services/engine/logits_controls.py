"""Logits controls: what a request's sampling parameters change in the logits before a draw.

Applied to a row's float32 logits before the sampler picks a token, greedy or sampled, in
vLLM's order:

0. structured output: the tokens the request's grammar does not allow next get -inf
   (``Draw.allowed``, from its matcher: engine/grammar.py).
1. ``min_tokens``: while the output is shorter, EOS (unless ``ignore_eos``) and every
   ``stop_token_ids`` entry get -inf, so nothing ends the output early.
2. ``logit_bias``: each listed token's bias is added to its logit.
3. ``repetition_penalty`` r (the CTRL paper's, as vLLM and transformers apply it): every token
   of the prompt or the output so far has its logit divided by r when positive, multiplied by
   r otherwise.
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's definition): each token's logit
   less f times its count in the output so far, less p if it occurs there at all.

A row depends only on its request's prompt and the output before the drawn position, so a
request continues exactly on any worker and through speculative verification (a drafted
position's history holds the drafts before it). ``min_p`` acts on probabilities after the
temperature and lives with top-k and top-p in the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tandem.services.protocol.request import SamplingParams


@dataclass(frozen=True)
class Draw:
    """One row's draw: its request's parameters and the tokens before it."""

    params: SamplingParams
    prompt: Seq[int]
    output: Seq[int]  # the output before this position (accepted drafts included)
    allowed: bytes | None = None  # structured output: the grammar's bitmask (bit t: token t)


def controlled(logits: torch.Tensor, draws: Seq[Draw], eos_token_ids: Seq[int]) -> torch.Tensor:
    """``logits`` [N, vocab] with each row's controls applied (a float32 copy when any row has
    them; ``logits`` itself when none does)."""
    if len(draws) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(draws)} draws")
    rows = [r for r, d in enumerate(draws) if d.params.adjusts_logits or d.allowed is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    masked = [r for r in rows if draws[r].allowed is not None]
    if masked:
        _apply_grammar(out, masked, [draws[r].allowed for r in masked])  # type: ignore[misc]
    for r in rows:
        _apply(out[r], draws[r], eos_token_ids)
    return out


def _apply_grammar(logits: torch.Tensor, rows: list[int], masks: list[bytes]) -> None:
    """-inf where the rows' grammar bitmasks (bit t of a mask: token t allowed; the bytes of
    little-endian 32-bit words) say no: all rows at once."""
    vocab, device = logits.shape[-1], logits.device
    packed = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8)
    packed = packed.view(len(rows), -1).to(device)
    bits = (packed.unsqueeze(-1) >> torch.arange(8, device=device, dtype=torch.uint8)) & 1
    refused = bits.view(len(rows), -1)[:, :vocab] == 0
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(refused,
                                                                             float("-inf")))


def _ids(tokens: Seq[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.int64, device=device)


def _apply(row: torch.Tensor, draw: Draw, eos_token_ids: Seq[int]) -> None:
    """The controls of one row, in place on its float32 logits [vocab]."""
    p, vocab, device = draw.params, row.shape[0], row.device
    if len(draw.output) < p.min_tokens:
        enders = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
        enders = [t for t in enders if t < vocab]
        if enders:
            row.index_fill_(0, _ids(enders, device), float("-inf"))
    bias = [(t, b) for t, b in p.logit_bias if t < vocab]
    if bias:
        ids, values = zip(*bias, strict=True)
        row.index_add_(0, _ids(ids, device),
                       torch.tensor(values, dtype=torch.float32, device=device))
    if p.repetition_penalty != 1.0:
        seen = torch.unique(_ids([*draw.prompt, *draw.output], device))
        logit = row.index_select(0, seen)
        row.index_copy_(0, seen, torch.where(logit > 0, logit / p.repetition_penalty,
                                             logit * p.repetition_penalty))
    if (p.frequency_penalty or p.presence_penalty) and draw.output:
        counts = torch.bincount(_ids(draw.output, device), minlength=vocab)[:vocab]
        row.sub_(counts.float() * p.frequency_penalty + (counts > 0).float() * p.presence_penalty)
