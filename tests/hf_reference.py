"""Greedy reference outputs from Hugging Face transformers on the same GGUF weights (float32)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

NEAR_TIE = 1e-3  # top-2 logit gap under which batched float arithmetic may flip the argmax


@dataclass
class Reference:
    tokens: list[int]
    gaps: list[float]  # reference top-1 minus top-2 logit at each generated position


def load_hf_model(gguf_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Reference:
    tokens: list[int] = []
    gaps: list[float] = []
    out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tokens.append(int(logits.argmax()))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache,
                    use_cache=True)
    return Reference(tokens, gaps)


@dataclass
class Comparison:
    matched: int  # leading tokens equal to the reference
    near_tie_at: int | None  # position where comparison stopped at a genuine near-tie


def compare(got: list[int], ref: Reference, label: str = "") -> Comparison:
    """Tokens must equal the reference; a flip at a reference near-tie ends the check."""
    assert len(got) == len(ref.tokens), f"{label}: {len(got)} tokens, expected {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(got, ref.tokens, strict=True)):
        if a != b:
            assert ref.gaps[i] < NEAR_TIE, (
                f"{label}: token {i} is {a}, transformers gives {b} "
                f"(top-2 gap {ref.gaps[i]:.4g} is no near-tie)"
            )
            print(f"{label}: near-tie at token {i} (gap {ref.gaps[i]:.2e}); comparison stops")
            return Comparison(i, i)
    return Comparison(len(got), None)
