"""Projections of a few rows on a GPU: ``x @ weight.T + bias`` as a Triton kernel that streams
the weight once.

A decode step multiplies a handful of rows (one per sequence) by every weight: the work is
reading the weights from memory, and a step's floor is their bytes over the memory bandwidth.
A program owns ``BLOCK_N`` output columns; it walks K in ``BLOCK_K`` steps, reading its
[BLOCK_N, BLOCK_K] weight tile once for every row of x. One row: a float32 product summed at
the end (no tensor cores); 2-16 rows: ``tl.dot`` on 16-row tiles. More rows than
``MAX_ROWS`` go to torch (cuBLAS), which is the better kernel once the weight tile is reused.

``TritonLinear`` is the projection the model uses on a GPU with the triton attention backend
(``model.py``): the same call as ``cpu_kernels.Linear``. Its tile choice per shape is
``launch_config``; ``tandem.loadtest.gpu_check``'s ``projections`` section times it against cuBLAS.
Sums are float32 in another order than cuBLAS's: results differ from torch's in the last bit
of the model dtype now and then, as two GEMM libraries do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem.services.engine.attention.triton_kernels import interpreting

MAX_ROWS = 16


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The tile per (rows bucket, N, K) where a GPU run measured one better than the default;
# ``gpu_check`` may set entries to try the ones its sweep found.
TUNED: dict[tuple[int, int, int], LaunchConfig] = {}


def rows_bucket(m: int) -> int:
    """1 for one row, else 16 (the tensor-core tile's rows)."""
    return 1 if m == 1 else MAX_ROWS


def launch_config(m: int, n: int, k: int) -> LaunchConfig:
    tuned = TUNED.get((rows_bucket(m), n, k))
    if tuned is not None:
        return tuned
    if m == 1:
        return LaunchConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
    return LaunchConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)


# The row count changes every step: not specialized on (no recompile for a new batch size).
# K is a constant of the kernel (a model has two or three): the loop's bounds are known.
@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, size_n, stride_x, stride_w, stride_o,
    SIZE_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """Program: output columns [pid * BLOCK_N, +BLOCK_N) of every row."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    col_ok = cols[:, None] < size_n
    row_ok = rows[:, None] < num_rows
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, SIZE_K, BLOCK_K):
            ks = k0 + offs_k
            if EVEN:
                w = tl.load(w_rows + ks[None, :])
                x = tl.load(x_ptr + ks)
            else:
                w = tl.load(w_rows + ks[None, :], mask=col_ok & (ks[None, :] < SIZE_K), other=0.0)
                x = tl.load(x_ptr + ks, mask=ks < SIZE_K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_rows = x_ptr + rows[:, None] * stride_x
        for k0 in range(0, SIZE_K, BLOCK_K):
            ks = k0 + offs_k
            x = tl.load(x_rows + ks[None, :], mask=row_ok & (ks[None, :] < SIZE_K), other=0.0)
            if EVEN:
                w = tl.load(w_rows + ks[None, :])
            else:
                w = tl.load(w_rows + ks[None, :], mask=col_ok & (ks[None, :] < SIZE_K), other=0.0)
            if INTERPRETER:  # it computes bfloat16 on the raw bit patterns: work in float32
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            out = tl.dot(x, tl.trans(w), out)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < size_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < size_n))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: LaunchConfig | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M, K] with M <= MAX_ROWS (rows may be strided, columns
    contiguous), weight [N, K] contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    assert 0 < m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1
    assert weight.is_contiguous()
    cfg = config or launch_config(m, n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    _linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, x.stride(0),
        weight.stride(0), out.stride(0), SIZE_K=k, HAS_BIAS=bias is not None, EVEN=even,
        BLOCK_M=rows_bucket(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        INTERPRETER=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@dataclass(frozen=True)
class TritonLinear:
    """``x @ weight.T + bias``: our kernel for up to ``MAX_ROWS`` rows, torch's beyond."""

    weight: torch.Tensor  # [out, in], contiguous
    bias: torch.Tensor | None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> TritonLinear:
        return cls(weight.contiguous(), bias)

    @staticmethod
    def usable(weight: torch.Tensor) -> bool:
        return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0 or x.shape[0] > MAX_ROWS or x.stride(-1) != 1:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
