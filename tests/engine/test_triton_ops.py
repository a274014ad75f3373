"""Our fused Triton kernels for a layer's small ops (``attention/triton_ops.py``) against the
torch ops of ``model.py`` they replace, and the model's fused path against its torch path.

What is bit-exact and what has a tolerance: the residual add, the rotary embedding (q, and k
as stored), v's store and the int8 cache's values and scales (``quantize_int8`` of the rotated
k and v) are exact: each op rounds where torch rounds and computes the same float32 values.
RMSNorm takes its float32 mean of squares in another summation order than torch, which can move
the normalized value by a float32 ulp and so, now and then, a bfloat16 result by one ulp (in
float32, a few ulps): the norms and anything after a Qwen3 q/k norm have that tolerance. SiLU's
exponential is Triton's (numpy's under the interpreter), not torch's: the same tolerance.

Without CUDA the kernels run under the Triton interpreter (set before they are imported). The
launches' sm_90 builds (registers, shared memory, spills) and their specializations are checked
without a GPU through ``tests/engine/sm90.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # setdefault: sm90.compile_launches sets it to 0
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.services.engine.attention import build_step_metadata, triton_ops  # noqa: E402
from tandem.services.engine.attention.torch_backend import TorchAttention  # noqa: E402
from tandem.services.engine.attention.triton_backend import TritonAttention  # noqa: E402
from tandem.services.engine.attention.triton_ops import (  # noqa: E402
    add_rms_norm,
    rms_norm,
    rotary_store,
    silu_mul,
)
from tandem.services.engine.config import ModelConfig  # noqa: E402
from tandem.services.engine.kv_cache import (  # noqa: E402
    KVCacheSpec,
    QuantizedKV,
    allocate_kv_cache,
    quantize_int8,
)
from tandem.services.engine.model import LlamaModel, _rotate_half  # noqa: E402
from tandem.services.engine.model import rms_norm as torch_rms_norm  # noqa: E402
from tests.engine.sm90 import H100_SHARED_BYTES, SpecializationRecorder, compile_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
TOKENS = pytest.mark.parametrize("num_tokens", [1, 5, 33])
HIDDEN = 96
HEADS, KV_HEADS, HEAD_DIM = 3, 1, 64  # GQA
EPS = 1e-5
BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS, LAYER = 16, 8, 2, 1
MAX_POSITIONS = 300


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def strided_rows(x: torch.Tensor, pad: int = 24) -> torch.Tensor:
    """x as a view with its row stride longer than its width (a fused projection's slice)."""
    wide = torch.full((x.shape[0], x.shape[1] + pad), float("nan"), dtype=x.dtype,
                      device=x.device)
    wide[:, pad // 2:pad // 2 + x.shape[1]] = x
    return wide[:, pad // 2:pad // 2 + x.shape[1]]


def strided_columns(x: torch.Tensor) -> torch.Tensor:
    """x as a view with every other column of a wider tensor."""
    return torch.stack([x, torch.full_like(x, float("nan"))], dim=-1).view(x.shape[0], -1)[:, ::2]


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor,
                      summed: bool = False, float32_ulps: int = 4) -> None:
    """Within one unit in the last place of bfloat16, mostly equal; in float32, where a
    normalized row moves as a whole and the weight's product rounds again, a few ulps.
    ``summed``: values that are sums of such ones (the rotary's), whose error is relative to
    the terms: ulps of the largest value."""
    assert actual.dtype == expected.dtype
    eps = torch.finfo(expected.dtype).eps
    ulps = float32_ulps if expected.dtype == torch.float32 else 1
    atol = 2 * ulps * eps * expected.abs().max().item() if summed else 1e-30
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ulps * eps, atol=atol)
    if expected.dtype != torch.float32:
        assert (actual != expected).float().mean() < 0.05


def rope_tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [MAX_POSITIONS, HEAD_DIM] as LlamaModel builds them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_POSITIONS, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


@DTYPES
@TOKENS
def test_rms_norm(dtype: torch.dtype, num_tokens: int) -> None:
    x = strided_rows(randn(num_tokens, HIDDEN, dtype=dtype, seed=num_tokens))
    weight = randn(HIDDEN, dtype=dtype, seed=100)
    assert_within_ulp(rms_norm(x, weight, EPS), torch_rms_norm(x, weight, EPS))


@DTYPES
@TOKENS
def test_add_rms_norm(dtype: torch.dtype, num_tokens: int) -> None:
    x = randn(num_tokens, HIDDEN, dtype=dtype, seed=num_tokens)
    delta = strided_rows(randn(num_tokens, HIDDEN, dtype=dtype, seed=num_tokens + 1))
    weight = randn(HIDDEN, dtype=dtype, seed=100)
    residual, normed = add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(residual, x + delta)  # bit-exact
    assert_within_ulp(normed, torch_rms_norm(x + delta, weight, EPS))


@DTYPES
@TOKENS
def test_silu_mul(dtype: torch.dtype, num_tokens: int) -> None:
    size = 100  # not a power of two
    gate_up = strided_rows(randn(num_tokens, 2 * size, dtype=dtype, seed=num_tokens) * 3)
    gate, up = gate_up.chunk(2, dim=-1)
    # On a GPU tl.exp is the hardware's approximate exp2 (an H200 gave 1 value in 3,300 at
    # 4.8e-7, just past 4 float32 ulps, after the product): 8 ulps there.
    assert_within_ulp(silu_mul(gate_up), F.silu(gate) * up, float32_ulps=8)


def reference_rotary_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, cache: torch.Tensor | QuantizedKV,
                           slots: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor] | None
                           ) -> torch.Tensor:
    """model.py's torch ops (q/k norm, rotary) and the store into a copy of ``cache`` (kept
    in place: the expected cache); returns the rotated q."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q = qkv[:, :q_size].view(-1, HEADS, HEAD_DIM)
    k = qkv[:, q_size:q_size + kv_size].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size:].view(-1, KV_HEADS, HEAD_DIM)
    if norms is not None:
        q, k = torch_rms_norm(q, norms[0], EPS), torch_rms_norm(k, norms[1], EPS)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    keep = slots >= 0
    blocks, offsets = slots[keep] // BLOCK_SIZE, slots[keep] % BLOCK_SIZE
    if isinstance(cache, QuantizedKV):
        cache.store(LAYER, k[keep], v[keep], blocks, offsets)  # quantize_int8's rows
    else:
        cache[:, LAYER, 0][blocks, offsets] = k[keep]
        cache[:, LAYER, 1][blocks, offsets] = v[keep]
    return q


def poisoned_cache(dtype: torch.dtype, int8: bool) -> torch.Tensor | QuantizedKV:
    """A cache full of random values (and scales), so a slot written by mistake shows."""
    spec = KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, NUM_LAYERS, KV_HEADS, HEAD_DIM,
                       "float32" if dtype == torch.float32 else "bfloat16",
                       "int8" if int8 else "auto")
    cache = allocate_kv_cache(spec, DEVICE)
    gen = torch.Generator().manual_seed(7)
    if isinstance(cache, QuantizedKV):
        cache.values.copy_(torch.randint(-127, 128, cache.values.shape, generator=gen))
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen))
    else:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return cache


def clone(cache: torch.Tensor | QuantizedKV) -> torch.Tensor | QuantizedKV:
    if isinstance(cache, QuantizedKV):
        data = cache.data.clone()
        split = cache.values[0].numel()  # a block's int8 values, then its scales
        return QuantizedKV(data, data[:, :split].view(torch.int8).view(cache.values.shape),
                           data[:, split:].view(torch.float32).view(cache.scales.shape))
    return cache.clone()


def step_rows(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and distinct slots for ``num_tokens`` rows, every third slot -1 (padding)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[1::3] = -1
    return positions.to(DEVICE), slots.to(DEVICE)


@DTYPES
@TOKENS
@pytest.mark.parametrize("layout", ["strided_rows", "strided_columns"])
@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_rotary_store(dtype: torch.dtype, num_tokens: int, layout: str,
                      cache_dtype: str) -> None:
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = randn(num_tokens, width, dtype=dtype, seed=num_tokens) * 2
    qkv = strided_rows(qkv) if layout == "strided_rows" else strided_columns(qkv)
    assert qkv.stride() != (width, 1)
    positions, slots = step_rows(num_tokens, seed=num_tokens)
    cos, sin = rope_tables(dtype)
    cache = poisoned_cache(dtype, cache_dtype == "int8")
    expected = clone(cache)
    q_ref = reference_rotary_store(qkv, positions, cos, sin, expected, slots, None)
    q = rotary_store(qkv, positions, cos, sin, cache, LAYER, slots, HEADS, KV_HEADS)
    # Everything bit-exact: q, the stored k and v (int8: values and scales), and every slot
    # not written (slot -1 rows, other slots, the other layer) as it was.
    assert torch.equal(q, q_ref)
    if isinstance(cache, QuantizedKV):
        assert isinstance(expected, QuantizedKV)
        assert torch.equal(cache.values, expected.values)
        assert torch.equal(cache.scales, expected.scales)
    else:
        assert torch.equal(cache, expected)


def test_rotary_store_int8_is_quantize_int8() -> None:
    # The int8 rows are quantize_int8 of the rotated k and v, spelled out once more.
    num_tokens = 4
    qkv = randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16, seed=3)
    positions, _ = step_rows(num_tokens, seed=3)
    slots = torch.arange(num_tokens, device=DEVICE) * 5
    cos, sin = rope_tables(torch.bfloat16)
    cache = poisoned_cache(torch.bfloat16, int8=True)
    assert isinstance(cache, QuantizedKV)
    rotary_store(qkv, positions, cos, sin, cache, LAYER, slots, HEADS, KV_HEADS)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(-1, KV_HEADS, HEAD_DIM)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for kv, x in enumerate((k * c + _rotate_half(k) * s, v)):
        values, scales = quantize_int8(x)
        blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
        assert torch.equal(cache.values[:, LAYER, kv][blocks, offsets], values)
        assert torch.equal(cache.scales[:, LAYER, kv][blocks, offsets], scales)


@DTYPES
def test_rotary_store_with_qk_norm(dtype: torch.dtype) -> None:
    # Qwen3: each head RMS-normed before the rotation (one ulp: the norm's sum).
    num_tokens = 5
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = strided_rows(randn(num_tokens, width, dtype=dtype, seed=9))
    norms = (randn(HEAD_DIM, dtype=dtype, seed=10), randn(HEAD_DIM, dtype=dtype, seed=11))
    positions, slots = step_rows(num_tokens, seed=9)
    cos, sin = rope_tables(dtype)
    cache = poisoned_cache(dtype, int8=False)
    expected = clone(cache)
    assert isinstance(cache, torch.Tensor) and isinstance(expected, torch.Tensor)
    q_ref = reference_rotary_store(qkv, positions, cos, sin, expected, slots, norms)
    q = rotary_store(qkv, positions, cos, sin, cache, LAYER, slots, HEADS, KV_HEADS,
                     norms[0], norms[1], EPS)
    assert_within_ulp(q, q_ref, summed=True)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    written = written.view(NUM_BLOCKS, BLOCK_SIZE)
    by_slot, expected_by_slot = cache[:, LAYER].transpose(1, 2), expected[:, LAYER].transpose(1, 2)
    assert_within_ulp(by_slot[written], expected_by_slot[written], summed=True)
    assert torch.equal(by_slot[~written], expected_by_slot[~written])
    assert torch.equal(cache[:, 1 - LAYER], expected[:, 1 - LAYER])


def tiny_model(backend: str, dtype: torch.dtype, qk_norm: bool) -> LlamaModel:
    """A random 2-layer model of the shapes above (Qwen3's per-head q/k norms with
    ``qk_norm``) on the torch attention backend, else the triton one."""
    config = ModelConfig(model_id="tiny", vocab_size=64, hidden_size=HIDDEN,
                         intermediate_size=100, num_layers=2, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS,
                         rope_theta=10000.0, max_position_embeddings=MAX_POSITIONS,
                         tie_word_embeddings=False, eos_token_ids=(0,), qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(5)

    def weight(*shape: int) -> torch.Tensor:
        if len(shape) == 1:  # a norm's
            return (1 + 0.2 * torch.randn(shape, generator=gen)).to(dtype)
        return (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(dtype)

    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {"model.embed_tokens.weight": weight(64, HIDDEN), "model.norm.weight": weight(HIDDEN),
         "lm_head.weight": weight(64, HIDDEN)}
    for i in range(2):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": weight(HIDDEN),
              p + "post_attention_layernorm.weight": weight(HIDDEN),
              p + "self_attn.q_proj.weight": weight(q_size, HIDDEN),
              p + "self_attn.k_proj.weight": weight(kv_size, HIDDEN),
              p + "self_attn.v_proj.weight": weight(kv_size, HIDDEN),
              p + "self_attn.o_proj.weight": weight(HIDDEN, q_size),
              p + "mlp.gate_proj.weight": weight(100, HIDDEN),
              p + "mlp.up_proj.weight": weight(100, HIDDEN),
              p + "mlp.down_proj.weight": weight(HIDDEN, 100)}
        if qk_norm:
            w |= {p + "self_attn.q_norm.weight": weight(HEAD_DIM),
                  p + "self_attn.k_norm.weight": weight(HEAD_DIM)}
    attention = (TorchAttention(HEADS // KV_HEADS) if backend == "torch"
                 else TritonAttention(KV_HEADS, HEAD_DIM, DEVICE))
    return LlamaModel(config, w, attention, MAX_POSITIONS, DEVICE)


@DTYPES
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_model_fused_path_matches_torch_path(dtype: torch.dtype, qk_norm: bool) -> None:
    # A prefill step of two sequences (7 and 5 tokens), then a decode step of both. The fused
    # path's logits against those of the same model without it (the layers' torch ops with
    # the backend's ``forward``: the same attention kernel) and of the torch backend's model
    # (torch's attention: in bfloat16 a couple of ulps of the logits apart).
    models = {b: tiny_model(b, dtype, qk_norm) for b in ("fused", "torch")}
    models["unfused"] = tiny_model("triton", dtype, qk_norm)
    models["unfused"].triton_ops = None
    assert models["fused"].triton_ops is not None and models["torch"].triton_ops is None
    spec = KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, 2, KV_HEADS, HEAD_DIM,
                       "float32" if dtype == torch.float32 else "bfloat16")
    caches = {b: allocate_kv_cache(spec, DEVICE) for b in models}
    tables = [[3], [5, 1]]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, 64, (12,), generator=gen).to(DEVICE)
    steps = [(tokens, [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], [7, 5], [7, 5]),
             (tokens[:2], [7, 5], [1, 1], [8, 6])]
    near, far = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    for input_ids, positions, query_lens, seq_lens in steps:
        step = build_step_metadata(query_lens, seq_lens, tables, 0, BLOCK_SIZE, DEVICE)
        rows = torch.tensor(query_lens, device=DEVICE).cumsum(0) - 1
        logits = {b: model(input_ids, torch.tensor(positions, device=DEVICE), caches[b],
                           model.attention.prepare(step), rows)
                  for b, model in models.items()}
        torch.testing.assert_close(logits["fused"], logits["unfused"], atol=near, rtol=near)
        torch.testing.assert_close(logits["fused"], logits["torch"], atol=far, rtol=far)


def layer_ops(num_tokens: int, dtype: torch.dtype, heads: tuple[int, int, int] = (32, 8, 128),
              hidden: int = 4096, intermediate: int = 14336, int8_cache: bool = False,
              qk_norm: bool = False, device: str = "cpu") -> None:
    """One layer's fused ops for ``num_tokens`` tokens of a model of these shapes (default:
    Llama-3-8B's). Under sm90.compile_launches (CPU tensors) compiled, never run."""
    num_heads, num_kv_heads, head_dim = heads
    spec = KVCacheSpec(16, 16, 2, num_kv_heads, head_dim,
                       "float32" if dtype == torch.float32 else "bfloat16",
                       "int8" if int8_cache else "auto")
    cache = allocate_kv_cache(spec, device)
    with torch.device(device):
        x = torch.zeros(num_tokens, hidden, dtype=dtype)
        norm = torch.ones(hidden, dtype=dtype)
        h = rms_norm(x, norm, EPS)
        add_rms_norm(x, h, norm, EPS)
        qkv = torch.zeros(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
        table = torch.zeros(64, head_dim, dtype=dtype)
        rows = torch.zeros(num_tokens, dtype=torch.long)
        head_norm = torch.ones(head_dim, dtype=dtype) if qk_norm else None
        rotary_store(qkv, rows, table, table, cache, 1, rows, num_heads, num_kv_heads,
                     head_norm, head_norm, EPS)
        silu_mul(torch.zeros(num_tokens, 2 * intermediate, dtype=dtype))


def llama3_8b_decode_and_prefill() -> None:
    """Llama-3-8B's layer ops in bfloat16 (float32 too; an int8 cache; Qwen3-style q/k norms)
    at T = 1 and 64."""
    for num_tokens in (1, 64):
        layer_ops(num_tokens, torch.bfloat16)
        layer_ops(num_tokens, torch.bfloat16, int8_cache=True)
        layer_ops(num_tokens, torch.bfloat16, qk_norm=True)
        layer_ops(num_tokens, torch.float32)


def test_llama3_8b_launches_fit_an_sm90_block() -> None:
    usages = compile_launches(f"{__name__}:llama3_8b_decode_and_prefill")
    kernels = {u.kernel for u in usages}
    assert kernels == {"_rms_norm_kernel", "_rotary_store_kernel", "_silu_mul_kernel"}
    assert all(u.constants["INTERPRETER"] is False for u in usages)
    over = [u for u in usages if u.shared_bytes > H100_SHARED_BYTES]
    assert not over, f"more shared memory than an sm_90 block has: {over}"
    spills = [u for u in usages if u.local_bytes]
    assert not spills, f"register spills: {spills}"


def test_batch_sizes_compile_no_new_variants() -> None:
    # A step of any number of tokens launches the variants of the first: the token count is a
    # grid size or an unspecialized argument, never a compile-time value.
    recorder = SpecializationRecorder()
    kernels = (triton_ops._rms_norm_kernel, triton_ops._rotary_store_kernel,
               triton_ops._silu_mul_kernel)
    with recorder.watching(*kernels):
        for num_tokens in (1, 2, 3, 16, 17, 33):
            layer_ops(num_tokens, torch.bfloat16, (HEADS, KV_HEADS, HEAD_DIM), HIDDEN, 100,
                      device=DEVICE)
    assert recorder.launches["_rotary_store_kernel"] == 6
    assert len(recorder.keys["_rms_norm_kernel"]) == 2  # with and without the residual add
    assert len(recorder.keys["_rotary_store_kernel"]) == 1
    assert len(recorder.keys["_silu_mul_kernel"]) == 1
