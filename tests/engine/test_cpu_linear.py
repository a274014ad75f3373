"""Prepacked oneDNN linears (bfloat16 on a CPU) compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.services.engine.cpu_kernels import Linear, packing_available

pytestmark = pytest.mark.skipif(not packing_available("cpu", torch.bfloat16),
                                reason="this torch has no oneDNN linear for bfloat16 here")


@pytest.mark.parametrize("tokens", [1, 3, 32, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(tokens: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(tokens)
    weight = torch.randn(384, 576, generator=gen).bfloat16()
    bias = torch.randn(384, generator=gen).bfloat16() if with_bias else None
    # A strided input, as the model's slices of a fused projection are.
    x = torch.randn(tokens, 2 * 576, generator=gen).bfloat16()[:, :576]
    packed = Linear.of(weight, bias, pack=True)
    assert packed.packed
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 384)
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=2e-2)
    torch.testing.assert_close(got, Linear.of(weight, bias)(x), atol=0.1, rtol=2e-2)


def test_only_bfloat16_on_a_cpu_is_packed() -> None:
    assert not packing_available("cpu", torch.float32)
    assert not packing_available("cuda", torch.bfloat16)
