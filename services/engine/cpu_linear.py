"""Linear layers on the CPU through oneDNN with prepacked bfloat16 weights.

``F.linear`` hands oneDNN a plain row-major bfloat16 weight every call, which it re-blocks on
the fly; for the small token counts of decode steps that dominates (this machine's AMX Xeon, a
4096x576 projection: 0.74 ms at 1 token, 0.85 ms at 32, against 0.49 and 0.50 ms prepacked).
``Linear.of(..., pack=True)`` reorders a weight once into oneDNN's blocked layout (the same
numbers, another order in memory) and runs it through oneDNN's linear. Whole engine, one
thread, interleaved runs (medians of 3): bfloat16 decoding at batch 1 9.5 -> 12.7 tok/s, at
batch 32 147 -> 152. float32 is left to ``F.linear``: packed it lost at batch 1 (10.5 -> 8.7)
what it won at 32 (87 -> 101). Off the CPU, or without oneDNN, nothing is packed.

``AmxLinear`` runs a bfloat16 projection through our own AMX kernel instead (csrc/linear.c,
with the ``cpu`` attention backend's kernels, on a CPU with AMX, one engine thread): the weight
packed once as AMX tiles, streamed in order. The 120 projections of a SmolLM2 decode step
(212 MB), one thread, medians of 5 interleaved (loadtest figures in docs/loadtest.md): 18.0 ms
against oneDNN's 22.9 at 1 token, 20.6 against 27.1 at 32, even at 128, 14-15% slower from
256 tokens on (98 against 83 ms at 512: oneDNN blocks larger and keeps both operands nearer
the core; prefill chunks pay that). Rows are summed in one order whatever the batch
(oneDNN's order changes with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.services.engine.cpu_kernels import Kernels, pack_linear, supports_linear

# A token count the packed layout is tuned for (decode batches); any count works.
PACK_BATCH_HINT = 32


def packing_available(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack and run bfloat16 weights here (its bfloat16 path needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU runs ``F.linear``)."""
    mkldnn = torch.ops.mkldnn
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype == torch.bfloat16 and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported")
            and bool(mkldnn._is_mkldnn_bf16_supported()))


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


@dataclass(frozen=True)
class AmxLinear:
    """``x @ weight.T + bias`` through our AMX kernel, the weight held as its tiles; with
    ``swiglu`` (a gate and up projection stacked), ``F.silu(gate) * up`` of the two in the
    same pass, the [tokens, 2 x intermediate] projection never written."""

    weight: torch.Tensor  # pack_linear's tiles of the [out, in] weight
    bias: torch.Tensor | None
    kernels: Kernels
    swiglu: bool = False
    threads: int = 1  # 2: a helper thread takes part of each call (csrc/linear.c)

    @classmethod
    def usable(cls, kernels: Kernels | None, weight: torch.Tensor, swiglu: bool = False
               ) -> bool:
        """Whether ``weight`` can run here: bfloat16 on a CPU with AMX, one torch thread (the
        kernel runs on the calling thread; oneDNN uses them all), a shape the tiles take."""
        return (kernels is not None and kernels.amx and weight.dtype == torch.bfloat16
                and weight.device.type == "cpu" and torch.get_num_threads() == 1
                and supports_linear(*weight.shape, swiglu=swiglu))

    @classmethod
    def of(cls, kernels: Kernels, weight: torch.Tensor, bias: torch.Tensor | None = None,
           swiglu: bool = False, threads: int = 1) -> AmxLinear:
        return cls(pack_linear(weight, swiglu), bias, kernels, swiglu, threads)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual`` ([tokens, out], 2-D ``x``): ``residual + self(x)`` written into it."""
        if x.dim() == 2:
            return self.kernels.linear(x, self.weight, self.bias, self.swiglu, self.threads,
                                       residual)
        if residual is not None:
            raise ValueError("a residual takes a 2-D input")
        y = self.kernels.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias,
                                self.swiglu, self.threads)
        return y.view(*x.shape[:-1], y.shape[-1])
