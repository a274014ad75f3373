"""Our fused bfloat16 CPU kernels (engine/cpu_kernels.py, csrc/fused_ops.c) against the torch
ops they replace in model.py: the rotary embedding bit for bit; RMSNorm and silu(gate) * up
within a float rounding before their bfloat16 rounding (a differently ordered sum, our exp).
Strided rows and widths that are not a multiple of 16 (the kernels' vector tails) included.
They need an x86 CPU with AVX-512 BF16 and a C compiler: elsewhere these tests skip saying so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.model import _rotate_half, rms_norm

REASON = cpu_kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cpu kernels: {REASON}")
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=GEN) * scale).bfloat16()


def assert_within_a_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or one bfloat16 step apart where a float rounding tipped the final one."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    ulp = 2.0 ** (torch.frexp(want.float()).exponent.float() - 8)
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert float((got == want).float().mean()) > 0.97  # most are the same bits


@pytest.mark.parametrize("dim", [576, 40])
def test_rms_norm(dim: int) -> None:
    wide = randn(9, dim + 24, scale=3.0)
    x = wide[:, :dim]  # strided rows, as a slice of a wider activation
    weight = randn(dim)
    got = cpu_kernels.load().rms_norm(x, weight, 1e-5)
    assert got.is_contiguous()
    assert_within_a_rounding(got, rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dim", [1536, 40])
def test_silu_mul(dim: int) -> None:
    gate_up = randn(7, 2 * dim, scale=4.0)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # exp's ends
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_a_rounding(cpu_kernels.load().silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("heads", "head_dim"), [(9, 64), (2, 128)])
def test_rotary_is_torchs_bits(heads: int, head_dim: int) -> None:
    tokens, positions = 11, torch.tensor([0, 5, 3, 200, 7, 7, 1, 99, 150, 2, 64])
    qkv = randn(tokens, (heads + 4) * head_dim)
    x = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided token rows
    angles = torch.outer(torch.arange(256.0), torch.rand(head_dim // 2, generator=GEN))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    want = x * cos[positions].unsqueeze(1) + _rotate_half(x) * sin[positions].unsqueeze(1)
    got = cpu_kernels.load().rotary(x, cos, sin, positions)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # signed zeros too


def test_kernels_refuse_what_they_do_not_take() -> None:
    kernels = cpu_kernels.load()
    with pytest.raises(ValueError, match="bfloat16 CPU tensors only"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.silu_mul(randn(8, 4).t())
