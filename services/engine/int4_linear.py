"""Linear layers on the CPU over a GGUF's Q4_1 weights as they are (``weight_format: int4``).

A Q4_1 block is 32 consecutive values of a weight row: a float16 scale ``d``, a float16 minimum
``m`` and 32 four-bit ``q`` (value ``j`` in the low nibble of byte ``j``, value ``16 + j`` in
its high nibble), ``w = d * q + m`` (``gguf.quants.Q4_1``). torch's groupwise int4 matmul on the
CPU (``aten._weight_int4pack_mm_for_cpu``) computes ``w = (q - 8) * scale + zero`` per group of
32 along the input dimension, so the same ``q`` serve with ``scale = d`` and
``zero = m + 8 * d``, no re-quantization. Its fast path wants ``scale`` and ``zero`` in bfloat16:
the weights are the GGUF's with ``d`` and ``m + 8d`` rounded to bfloat16.

The tied embedding / ``lm_head`` of such a GGUF is often Q8_0: blocks of 32 signed 8-bit ``q``
and a float16 ``d``, ``w = d * q``. With ``u = q + 128 = 16 * hi + lo`` (``hi``, ``lo`` in
0..15) it is the sum of two int4 weights, ``hi`` with ``scale = 16d, zero = 0`` and ``lo`` with
``scale = d, zero = 8d`` (``16d * hi + d * lo - 128d``), each scale and zero a power-of-two
multiple of ``d`` in bfloat16: the head is ``bfloat16(d) * q`` exactly, two int4 matmuls (a
third of the bytes of its bfloat16 copy), the embedding lookup staying dense.

The int4 kernel wins only at a few tokens (measured on this machine's CPU, one thread: a whole
batch-1 decode step of the built-in model, see docs/loadtest.md); from ``INT4_MAX_TOKENS`` up
(prefill chunks, decode batches) ``Int4Linear`` runs a dense bfloat16 copy of the same weights,
dequantized from the pack (prepacked for oneDNN, or our AMX kernel's ``AmxLinear`` where the
model runs it), so both paths multiply by identical weight values and only the kernel's
accumulation differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.services.engine.cpu_kernels import AmxLinear, Linear

GROUP = 32  # values per Q4_1 / Q8_0 block = torch's int4 group size here
_Q4_1_BLOCK_BYTES = 2 + 2 + GROUP // 2
_Q8_0_BLOCK_BYTES = 2 + GROUP
# Token counts up to this run the int4 kernel; more run the dense copy.
INT4_MAX_TOKENS = 4


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass(frozen=True)
class Q4Weight:
    """A weight ``[out, in]`` as ``(q - 8) * scale + zero``, one scale and zero per 32 inputs."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in / 32] bfloat16
    zero: torch.Tensor  # [out, in / 32] bfloat16

    @classmethod
    def from_q4_1(cls, blocks: np.ndarray, shape: tuple[int, int]) -> Q4Weight:
        """``blocks``: a GGUF Q4_1 tensor's bytes, ``shape``: its ``[out, in]``."""
        out, inp = shape
        raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(out, inp // GROUP,
                                                                   _Q4_1_BLOCK_BYTES)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, inp)
        return cls(torch.from_numpy(q.copy()),
                   torch.from_numpy(d).to(torch.bfloat16),
                   torch.from_numpy(m + 8 * d).to(torch.bfloat16))

    @classmethod
    def pair_from_q8_0(cls, blocks: np.ndarray, shape: tuple[int, int]
                       ) -> tuple[Q4Weight, Q4Weight]:
        """A GGUF Q8_0 tensor as two int4 weights whose sum is ``bfloat16(d) * q``."""
        out, inp = shape
        raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(out, inp // GROUP,
                                                                   _Q8_0_BLOCK_BYTES)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        d = d.to(torch.bfloat16)
        u = torch.from_numpy(raw[..., 2:].reshape(out, inp).copy()) ^ 0x80  # int8 q + 128
        zero = torch.zeros_like(d)
        return cls(u >> 4, d * 16, zero), cls(u & 0x0F, d, d * 8)

    @classmethod
    def cat(cls, parts: Sequence[Q4Weight]) -> Q4Weight:
        """Stacked along ``out`` (fused projections)."""
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.zero for p in parts]))

    def rows(self, order: np.ndarray) -> Q4Weight:
        """Rows reordered (``order[i]``: the row that becomes row ``i``)."""
        index = torch.from_numpy(np.ascontiguousarray(order))
        return Q4Weight(self.q[index], self.scale[index], self.zero[index])

    def dequantize(self) -> torch.Tensor:
        """The weight in float32, exactly ``(q - 8) * scale + zero``."""
        scale = self.scale.float().repeat_interleave(GROUP, dim=1)
        zero = self.zero.float().repeat_interleave(GROUP, dim=1)
        return (self.q.float() - 8) * scale + zero


@dataclass(frozen=True)
class Int4Linear:
    """``x @ weight.T + bias`` like ``cpu_kernels.Linear``, the weight a sum of int4 terms (one;
    two for a Q8_0 head): the int4 kernel for up to ``max_tokens`` tokens, else ``dense``
    (the same weights in bfloat16)."""

    # Per term: torch's int4 pack of q, and [in / 32, out, 2] bfloat16 scales and zeros.
    terms: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    dense: Linear | AmxLinear
    max_tokens: int = INT4_MAX_TOKENS

    @classmethod
    def of(cls, weight: Q4Weight | Sequence[Q4Weight], bias: torch.Tensor | None = None,
           pack: bool = True, max_tokens: int = INT4_MAX_TOKENS,
           dense: Callable[[torch.Tensor, torch.Tensor | None], Linear | AmxLinear] | None = None
           ) -> Int4Linear:
        """``dense``: builds the bfloat16 projection from the dequantized weight and the bias
        (default: a ``Linear``, oneDNN-packed when ``pack``)."""
        weights = (weight,) if isinstance(weight, Q4Weight) else tuple(weight)
        terms = tuple((torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1),
                       torch.stack([w.scale.t(), w.zero.t()], dim=-1).contiguous())
                      for w in weights)
        exact = sum((w.dequantize() for w in weights), torch.zeros(()))
        exact = exact.to(torch.bfloat16)
        return cls(terms, dense(exact, bias) if dense else Linear.of(exact, bias, pack),
                   max_tokens)

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.dense.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_tokens or x.dim() != 2:
            return self.dense(x)
        x = x.contiguous()
        out = None
        for packed, scales_zeros in self.terms:
            term = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
            out = term if out is None else out.add_(term)
        assert out is not None
        return out if self.bias is None else out + self.bias
