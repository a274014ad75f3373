"""Linear layers on the CPU through oneDNN with prepacked bfloat16 weights.

``F.linear`` hands oneDNN a plain row-major bfloat16 weight every call, which it re-blocks on
the fly; for the small token counts of decode steps that dominates (this machine's AMX Xeon, a
4096x576 projection: 0.74 ms at 1 token, 0.85 ms at 32, against 0.49 and 0.50 ms prepacked).
``Linear.of(..., pack=True)`` reorders a weight once into oneDNN's blocked layout (the same
numbers, another order in memory) and runs it through oneDNN's linear. Whole engine, one
thread, interleaved runs (medians of 3): bfloat16 decoding at batch 1 9.5 -> 12.7 tok/s, at
batch 32 147 -> 152. float32 is left to ``F.linear``: packed it lost at batch 1 (10.5 -> 8.7)
what it won at 32 (87 -> 101). Off the CPU, or without oneDNN, nothing is packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A token count the packed layout is tuned for (decode batches); any count works.
PACK_BATCH_HINT = 32


def packing_available(device: str | torch.device, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype == torch.bfloat16
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@dataclass(frozen=True)
class Linear:
    """``x @ weight.T + bias``, with the weight packed for oneDNN when ``packed``."""

    weight: torch.Tensor  # [out, in]; a oneDNN-ordered copy when packed
    bias: torch.Tensor | None
    packed: bool

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pack: bool = False) -> Linear:
        if not pack:
            return cls(weight, bias, False)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
        return cls(packed, bias, True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias,
                                                  "none", [], "")
