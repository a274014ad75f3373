"""Our fused bfloat16 CPU kernels (engine/cpu_kernels.py, csrc/fused_ops.c) against the torch
ops they replace in model.py: the rotary embedding and the K/V store bit for bit; RMSNorm and
silu(gate) * up within a float rounding before their bfloat16 rounding (a differently ordered
sum, our exp). Strided rows and widths that are not a multiple of 16 (the kernels' vector
tails) included; prefill-sized calls split over the helper thread give one thread's bits.
They need an x86 CPU with AVX-512 BF16 and a C compiler: elsewhere these tests skip saying so."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.services.engine import cpu_kernels
from tandem.services.engine.cpu_kernels import AmxLinear
from tandem.services.engine.model import _rotate_half, rms_norm

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


def test_rms_norm_on_two_threads_is_one_threads_bits() -> None:
    kernels = cpu_kernels.load()
    x, weight = randn(203, 600)[:, :576], randn(576)  # 7 units of 32 rows, the last short
    one = kernels.rms_norm(x, weight, 1e-5)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5, threads=2), one)
    assert_within_a_rounding(one, rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dim", [1536, 40])
def test_silu_mul(dim: int) -> None:
    gate_up = randn(7, 2 * dim, scale=4.0)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # exp's ends
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_a_rounding(cpu_kernels.load().silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("heads", "head_dim", "tokens", "threads"),
                         [(9, 64, 11, 1), (2, 128, 11, 1), (9, 64, 75, 2)])
def test_rotary_is_torchs_bits(heads: int, head_dim: int, tokens: int, threads: int) -> None:
    """Queries and keys (a third of the heads, as GQA has) in one call, each a strided view
    of the fused qkv projection; 75 tokens on two threads: three units of 32 tokens."""
    kv_heads = max(1, heads // 3)
    positions = torch.randint(0, 256, (tokens,), generator=GEN)
    positions[:3] = torch.tensor([0, 255, 7])
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.outer(torch.arange(256.0), torch.rand(head_dim // 2, generator=GEN))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    got_q, got_k = cpu_kernels.load().rotary(q, k, cos, sin, positions, threads)
    for got, x in ((got_q, q), (got_k, k)):
        want = x * cos[positions].unsqueeze(1) + _rotate_half(x) * sin[positions].unsqueeze(1)
        assert got.is_contiguous()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # signed zeros too


def test_rotary_refuses_positions_outside_its_tables() -> None:
    """A position at or past the cos/sin tables' rows, or negative, raises instead of reading
    past them; int32 positions are refused (the model converts once a step)."""
    q, k = randn(2, 9, 64), randn(2, 3, 64)
    cos = sin = randn(16, 64)
    kernels = cpu_kernels.load()
    for positions in ([0, 16], [-1, 3]):
        with pytest.raises(RuntimeError, match="kernel failed"):
            kernels.rotary(q, k, cos, sin, torch.tensor(positions))
    with pytest.raises(ValueError, match="layout"):
        kernels.rotary(q, k, cos, sin, torch.tensor([0, 1], dtype=torch.int32))


def test_store_kv_is_the_torch_backends_store() -> None:
    """A step's K/V (strided views of qkv) into one layer of a paged cache laid out as the
    engine's [blocks, layers, 2, block_size, Hkv, D]: the torch backend's indexed store."""
    blocks, layers, block_size, kv_heads, head_dim, tokens = 6, 3, 4, 3, 64, 9
    cache = randn(blocks, layers, 2, block_size, kv_heads, head_dim)
    want = cache.clone()
    qkv = randn(tokens, 5 * kv_heads * head_dim)
    k = qkv[:, 3 * kv_heads * head_dim:4 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 4 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=GEN)[:tokens]
    block_ids, offsets = slots // block_size, slots % block_size
    want[:, 1, 0][block_ids, offsets] = k
    want[:, 1, 1][block_ids, offsets] = v
    cpu_kernels.load().store_kv(k, v, cache[:, 1, 0], cache[:, 1, 1], block_ids, offsets)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))


def test_store_kv_refuses_a_slot_outside_the_cache() -> None:
    """A block id or offset past the cache (or negative) raises and writes nothing, not even
    the tokens before it."""
    blocks, block_size, kv_heads, head_dim = 4, 4, 3, 64
    cache = randn(blocks, 1, 2, block_size, kv_heads, head_dim)
    before = cache.clone()
    k, v = randn(3, kv_heads, head_dim), randn(3, kv_heads, head_dim)
    kernels = cpu_kernels.load()
    for block_ids, offsets in (([0, 1, blocks], [0, 0, 0]), ([0, -1, 2], [0, 0, 0]),
                               ([0, 1, 2], [0, block_size, 0]), ([0, 1, 2], [-1, 0, 0])):
        with pytest.raises(RuntimeError, match="kernel failed"):
            kernels.store_kv(k, v, cache[:, 0, 0], cache[:, 0, 1], torch.tensor(block_ids),
                             torch.tensor(offsets))
        assert torch.equal(cache.view(torch.int16), before.view(torch.int16))


def test_argmax_is_torchs_max_index() -> None:
    """The greedy pick: the first of equal values, a NaN counting as largest (the first NaN),
    +-0 equal, infinities, rows shorter than a vector and ties across vectors."""
    x = torch.randn(9, 49152, generator=GEN)
    x[0] = 0.0
    x[0, 5] = -0.0
    x[1, 100], x[1, 50] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3, 40000] = x[3, 7] = x[3].max() + 1
    x[4, 49151] = 1e9
    x[5, 49150] = float("nan")
    x[6] = float("inf")
    kernels = cpu_kernels.load()
    assert torch.equal(kernels.argmax(x), x.max(dim=-1).indices)
    short = torch.randn(3, 33, generator=GEN)
    short[1, 32] = float("nan")
    assert torch.equal(kernels.argmax(short), short.max(dim=-1).indices)
    assert torch.equal(kernels.argmax(x[:, :7]), x[:, :7].max(dim=-1).indices)  # strided rows


def test_kernels_refuse_what_they_do_not_take() -> None:
    kernels = cpu_kernels.load()
    with pytest.raises(ValueError, match="bfloat16 CPU tensors only"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.silu_mul(randn(8, 4).t())


AMX = REASON is None and cpu_kernels.load().amx
needs_amx = pytest.mark.skipif(not AMX, reason="the linear kernel needs AMX (amx_tile, "
                                               "amx_bf16) and Linux's leave to use it")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_kernels.load().linear(x, cpu_kernels.pack_linear(weight), bias)


@needs_amx
@pytest.mark.parametrize("shape", [(960, 576), (48, 64), (80, 96), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 100, 700])
def test_the_linear_kernel_rounds_the_exact_product_once(shape: tuple[int, int], rows: int
                                                        ) -> None:
    """Against the float64 product: one bfloat16 rounding, plus what a float sum can lose.
    Odd block counts (3 and 5 blocks of 16 outputs), rows past 16 and 32 (the tiles' tails),
    rows past the kernel's 1 MiB chunk of x (700 x 1536), strided rows, a bias."""
    out_features, in_features = shape
    x = randn(rows, in_features + 64)[:, 32:32 + in_features]
    weight, bias = randn(out_features, in_features, scale=0.05), randn(out_features)
    got = linear(x, weight, bias)
    exact = x.double() @ weight.double().T + bias.double()
    ulp = 2.0 ** (torch.frexp(exact.float()).exponent.double() - 8)
    float_error = 1e-6 * (x.double().abs() @ weight.double().abs().T)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert bool(((got.double() - exact).abs() <= ulp / 2 + float_error).all())


@needs_amx
def test_a_linear_row_does_not_depend_on_the_batch() -> None:
    """A row's bits are the same alone, in a batch, or as a batch's tail (so a speculative
    verify row equals its plain decode row)."""
    weight = randn(960, 576, scale=0.05)
    tiles = cpu_kernels.pack_linear(weight)
    x = randn(45, 576)
    batch = cpu_kernels.load().linear(x, tiles, None)
    for row in (0, 15, 16, 31, 32, 44):
        alone = cpu_kernels.load().linear(x[row:row + 1], tiles, None)
        assert torch.equal(alone[0], batch[row])
    assert torch.equal(cpu_kernels.load().linear(x[20:], tiles, None), batch[20:])


@needs_amx
@pytest.mark.parametrize("shape", [(96, 64), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 17, 33, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_in_the_projection_is_the_projection_then_silu_mul(
        shape: tuple[int, int], rows: int, with_bias: bool) -> None:
    """The gate and up projection with the activation in its pass: the same bits as the
    projection followed by the fused silu(gate) * up (3 pairs of output blocks: an odd
    count)."""
    out_features, in_features = shape
    x = randn(rows, in_features + 32)[:, :in_features]
    weight = randn(out_features, in_features, scale=0.1)
    bias = randn(out_features) if with_bias else None
    kernels = cpu_kernels.load()
    fused = kernels.linear(x, cpu_kernels.pack_linear(weight, swiglu=True), bias, swiglu=True)
    assert fused.shape == (rows, out_features // 2)
    assert torch.equal(fused, kernels.silu_mul(linear(x, weight, bias)))


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_residual_added_in_the_projection_is_torchs_sum(rows: int, threads: int) -> None:
    """``residual + linear(x)`` written into the residual as the projection is: torch's bits
    for the sum of the bfloat16 projection and the residual."""
    kernels = cpu_kernels.load()
    weight, bias = randn(96, 64, scale=0.1), randn(96)
    tiles = cpu_kernels.pack_linear(weight)
    x, residual = randn(rows, 96)[:, :64], randn(rows, 96, scale=4.0)
    want = residual + kernels.linear(x, tiles, bias)
    got = kernels.linear(x, tiles, bias, threads=threads, residual=residual)
    assert got is residual
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="residual"):
        kernels.linear(x, tiles, bias, residual=randn(rows, 96)[:, :80])


@needs_amx
@pytest.mark.parametrize("swiglu", [False, True])
def test_two_threads_give_the_same_bits_as_one(swiglu: bool) -> None:
    """The helper thread takes units (pairs of output blocks, per chunk of rows) from the back:
    whichever thread sums an output, it is the same sum. Odd pair counts (5 and 3 blocks of
    16), tiles' tails and rows past the 1 MiB chunk (two chunks of units)."""
    kernels = cpu_kernels.load()
    for out_features, in_features in [(96, 64), (80, 96), (3072, 576), (576, 1536)]:
        if swiglu and out_features % 32:
            continue
        tiles = cpu_kernels.pack_linear(randn(out_features, in_features, scale=0.05), swiglu)
        bias = randn(out_features)
        for rows in (1, 17, 33, 700):
            x = randn(rows, in_features + 32)[:, :in_features]
            one = kernels.linear(x, tiles, bias, swiglu, threads=1)
            assert torch.equal(kernels.linear(x, tiles, bias, swiglu, threads=2), one)


def test_the_helper_thread_sleeps_when_the_kernels_are_idle() -> None:
    """Two-thread calls start one helper thread (named, for top -H); with no calls it sleeps
    on a futex instead of spinning: an idle engine burns no CPU."""
    kernels = cpu_kernels.load()
    step = make_decode_batch()
    for _ in range(3):
        kernels.decode_attention(*step, threads=2)
    helpers = [task for task in Path("/proc/self/task").iterdir()
               if (task / "comm").read_text().strip() == "tandem-kernels"]
    assert len(helpers) == 1
    deadline = time.monotonic() + 10
    while _state(helpers[0]) != "S":  # spins SPIN_NS (0.2 ms) after a call, then sleeps
        assert time.monotonic() < deadline, "the helper thread is still running"
        time.sleep(0.01)


def _state(task: Path) -> str:
    return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]


def make_decode_batch() -> tuple[Any, ...]:
    """Arguments of ``decode_attention`` for 4 sequences of one [blocks, 16, 3, 64] cache."""
    keys, values = randn(32, 16, 3, 64), randn(32, 16, 3, 64)
    q = randn(4, 9, 64)
    tables = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    seq_lens = torch.tensor([5, 100, 128, 33], dtype=torch.int32)
    return q, torch.empty_like(q), keys, values, tables, seq_lens, 1, 0.125


def test_the_linear_kernel_refuses_what_its_tiles_cannot_hold() -> None:
    with pytest.raises(ValueError, match="a 100x576 weight"):
        cpu_kernels.pack_linear(randn(100, 576))
    with pytest.raises(ValueError, match="a 96x48 weight"):
        cpu_kernels.pack_linear(randn(96, 48))
    with pytest.raises(ValueError, match="a 48x64 weight .outputs a multiple of 32"):
        cpu_kernels.pack_linear(randn(48, 64), swiglu=True)
    if AMX:
        with pytest.raises(ValueError, match="tiles that do not fit x"):
            cpu_kernels.load().linear(randn(2, 64), cpu_kernels.pack_linear(randn(96, 96)), None)


@needs_amx
def test_amx_linear_is_used_only_where_it_runs_as_packed() -> None:
    weight = randn(96, 64)
    kernels = cpu_kernels.load()
    layer = AmxLinear.of(kernels, weight)
    x = randn(2, 3, 64)  # leading dimensions kept
    assert torch.equal(layer(x), linear(x.reshape(6, 64), weight, None).view(2, 3, 96))
    assert AmxLinear.usable(kernels, weight)
    assert not AmxLinear.usable(kernels, weight.float())  # bfloat16 only
    assert not AmxLinear.usable(kernels, randn(100, 64))  # outputs not a multiple of 16
    assert AmxLinear.usable(kernels, randn(48, 64))
    assert not AmxLinear.usable(kernels, randn(48, 64), swiglu=True)  # 24 gate, 24 up
    assert not AmxLinear.usable(None, weight)  # no kernels: the torch backend
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # oneDNN would use both; the kernel runs on one
    try:
        assert not AmxLinear.usable(kernels, weight)
    finally:
        torch.set_num_threads(threads)
