"""Our Triton projection for a few rows (``triton_linear``) against a float32 product: one row
(the float32 sum) and 2-16 rows (``tl.dot``), with and without a bias, shapes that fill the
tiles and shapes that do not; more rows than the kernel takes go to torch.

Without CUDA the kernel runs under the Triton interpreter, which rounds float32 to bfloat16 by
truncation: bfloat16 results are within 2 ulps there (1 on a GPU, rounding to nearest)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.loadtest.gpu_check import PROJECTION_CONFIGS  # noqa: E402
from tandem.services.engine.triton_linear import (  # noqa: E402
    MAX_ROWS,
    LaunchConfig,
    TritonLinear,
    launch_config,
    linear,
)
from tests.engine.sm90 import H100_SHARED_BYTES, compile_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILE = LaunchConfig(block_n=32, block_k=64, num_warps=4, num_stages=2)


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def assert_close_to_float32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                            b: torch.Tensor | None) -> None:
    exact = x.float() @ w.float().T + (b.float() if b is not None else 0)
    ulp = torch.finfo(out.dtype).eps * exact.abs().clamp_min(1.0)
    assert out.shape == exact.shape and out.dtype == x.dtype
    assert ((out.float() - exact).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "n", "k", "bias"), [
    (1, 96, 256, False),   # one row, tiles filled
    (1, 100, 300, True),   # one row, ragged N and K, a bias
    (3, 96, 256, False),   # a few rows on a 16-row tile
    (5, 64, 512, True),
    (16, 40, 200, False),  # a full row tile, ragged columns
])
def test_matches_float32_product(m: int, n: int, k: int, bias: bool, dtype: torch.dtype
                                 ) -> None:
    x, w, b = operands(m, n, k, dtype, bias, seed=m * n + k)
    assert_close_to_float32(linear(x, w, b, SMALL_TILE), x, w, b)


def test_strided_rows_and_default_tiles() -> None:
    """Rows of a wider tensor (a slice, as the model passes), each size's default tile."""
    x, w, b = operands(4, 64, 256, torch.bfloat16, True, seed=7)
    wide = torch.cat([x, x], dim=1)[:, :256]
    assert wide.stride(0) == 512
    for rows in (1, 4):
        assert launch_config(rows, 64, 256) is not None
        assert_close_to_float32(linear(wide[:rows], w, b), x[:rows], w, b)


def test_projection_falls_back_to_torch_past_its_rows() -> None:
    x, w, b = operands(MAX_ROWS + 1, 32, 64, torch.bfloat16, True, seed=9)
    projection = TritonLinear.of(w, b)
    assert torch.equal(projection(x), F.linear(x, w, b))
    assert_close_to_float32(projection(x[:3]), x[:3], w, b)


def test_usable_only_on_cuda_in_half_precision() -> None:
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert not TritonLinear.usable(w)  # a CPU tensor
    if torch.cuda.is_available():
        assert TritonLinear.usable(w.cuda())
        assert not TritonLinear.usable(w.float().cuda())


def every_tile() -> None:
    """The kernel at its default tiles and every tile ``gpu_check`` sweeps, on Llama-3-8B's
    K values, 1 and 16 rows (compiled for sm_90 by ``sm90.compile_launches``, never run)."""
    for rows, configs in PROJECTION_CONFIGS.items():
        for k in (4096, 14336):
            x = torch.empty(rows, k, dtype=torch.bfloat16)
            w = torch.empty(4096, k, dtype=torch.bfloat16)
            for config in [None, *configs]:
                linear(x, w, w[:, 0].contiguous(), config)


def test_every_tile_compiles_for_sm90_without_spills() -> None:
    usages = compile_launches(f"{__name__}:every_tile")
    assert {u.constants["BLOCK_M"] for u in usages} == {1, MAX_ROWS}
    assert len(usages) >= 2 * (len(PROJECTION_CONFIGS[1]) + len(PROJECTION_CONFIGS[16]))
    assert not [u for u in usages if u.shared_bytes > H100_SHARED_BYTES]
    spills = [(u.constants, u.local_bytes) for u in usages if u.local_bytes]
    assert not spills, f"register spills: {spills}"
