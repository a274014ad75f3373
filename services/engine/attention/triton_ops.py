"""Fused Triton kernels for a decoder layer's small ops (the model's path with the ``triton``
attention backend): each replaces a chain of torch ops with one launch.

- ``rms_norm(x, weight, eps)``: Hugging Face's RMSNorm of each row of x [T, H],
  ``weight * (x * rsqrt(mean(x**2) + eps)).to(dtype)``, the mean of squares in float32.
- ``add_rms_norm(x, delta, weight, eps)``: the new residual ``r = x + delta`` and
  ``rms_norm(r, weight, eps)`` in one pass over the row; returns both. (Both norms: a program
  per row, H rounded up to a power of two.)
- ``rotary_store(qkv, positions, cos, sin, kv_cache, layer, slot_mapping, num_heads,
  num_kv_heads)``: from the fused projection's rows qkv [T, (Hq + 2 Hkv) * D] (any strides),
  the rotary embedding ``x * cos + rotate_half(x) * sin`` of q and k, cos and sin read at each
  token's position from the [max_positions, D] tables; the rotated k and v are stored at
  ``slot_mapping`` as ``store_kv`` does (slot -1: none; an int8 cache quantized by its
  ``_quantize_rows``) and the rotated q is returned [T, Hq, D]. ``q_norm`` / ``k_norm``
  (Qwen3): each head's RMSNorm over D first. Programs: (token, BLOCK_Q query heads) and
  (token, BLOCK_KV KV heads).
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of gate_up [T, 2I] (gate first), [T, I] out;
  programs own [BLOCK_T, BLOCK_I] tiles.

Rounding follows torch's: operands are loaded as float32 and every result torch holds in the
model dtype is rounded to it (to nearest even) before it is used, so the values equal torch's
except for a float32 sum taken in another order (the norms' mean of squares) and the last bit
of an exponential (SiLU). Divisions and the square root are IEEE ones (``div_rn``, ``sqrt_rn``:
torch's on a CPU), and launches disable FMA contraction (float32 models round ``x * cos`` and
``rotate_half(x) * sin`` before adding them, as torch does).

The Triton interpreter (``TRITON_INTERPRET=1``) converts float32 to bfloat16 by truncation;
there ``_round`` rounds bfloat16 on the bits instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.services.engine.attention.triton_kernels import (
    _is_power_of_two,
    _quantize_rows,
    interpreting,
)
from tandem.services.engine.kv_cache import KVCache, QuantizedKV

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_ELEMENTS_PER_PROGRAM = 1024  # a rotary tile, a silu_mul tile row: 8 values a thread of 4 warps


@triton.jit
def _round(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """x (float32) rounded to DTYPE to nearest even, as float32."""
    if INTERPRETER and DTYPE == tl.bfloat16:  # noqa: SIM300 (the interpreter truncates)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_normed(x, weight, size, eps, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """RMSNorm of each row of x [R, C] (float32; columns past ``size`` zero) times weight
    [1, C], rounded as torch: (x * rsqrt(mean(x**2) + eps)).to(DTYPE), then * weight."""
    mean = tl.div_rn(tl.sum(x * x, 1), size * 1.0)
    inv = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    return _round(weight * _round(x * inv[:, None], DTYPE, INTERPRETER), DTYPE, INTERPRETER)


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, residual_ptr, out_ptr, weight_ptr, hidden, eps,
    stride_x, stride_d, stride_r, stride_o,
    BLOCK: tl.constexpr, ADD: tl.constexpr, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """One program per row: out = rms_norm(x), or with ADD of the residual x + delta, which
    is stored too."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = _round(x + delta.to(tl.float32), DTYPE, INTERPRETER)
        tl.store(residual_ptr + row * stride_r + cols, x.to(DTYPE), mask=mask)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _rms_normed(x, weight, hidden, eps, DTYPE, INTERPRETER)
    tl.store(out_ptr + row * stride_o + cols, out.to(DTYPE), mask=mask)


@triton.jit
def _rotated(
    row_ptr, heads, head_ok, stride_c, cos, sin, norm_ptr, eps,
    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """Heads ``heads`` of one token's row (head h at columns h * HEAD_DIM ..), with NORM
    RMS-normed by norm_ptr's weights first, rotated: float32 [len(heads), HEAD_DIM] holding
    DTYPE values."""
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM  # rotate_half's source column
    mask = head_ok[:, None]
    cols = heads[:, None] * HEAD_DIM
    x = tl.load(row_ptr + (cols + dims[None, :]) * stride_c, mask=mask, other=0.0)
    x_partner = tl.load(row_ptr + (cols + partner[None, :]) * stride_c, mask=mask, other=0.0)
    x = x.to(tl.float32)
    x_partner = x_partner.to(tl.float32)
    if NORM:  # the partner column is the same head's: the same mean of squares
        mean = tl.div_rn(tl.sum(x * x, 1), HEAD_DIM * 1.0)
        inv = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))[:, None]
        weight = tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        weight_partner = tl.load(norm_ptr + partner).to(tl.float32)[None, :]
        x = _round(weight * _round(x * inv, DTYPE, INTERPRETER), DTYPE, INTERPRETER)
        x_partner = _round(weight_partner * _round(x_partner * inv, DTYPE, INTERPRETER),
                           DTYPE, INTERPRETER)
    rotated = tl.where(dims[None, :] < HEAD_DIM // 2, -x_partner, x_partner)
    return _round(_round(x * cos[None, :], DTYPE, INTERPRETER)
                  + _round(rotated * sin[None, :], DTYPE, INTERPRETER), DTYPE, INTERPRETER)


@triton.jit
def _rotary_store_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    key_scale_ptr, value_scale_ptr, slot_mapping_ptr, q_norm_ptr, k_norm_ptr,
    num_heads, num_kv_heads, q_programs, eps,
    stride_t, stride_c, stride_cos, stride_sin, stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr, DTYPE: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Program (token, part): parts below q_programs rotate BLOCK_Q query heads into q; the
    others rotate BLOCK_KV KV heads of k and store them with v's (none for slot -1)."""
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = qkv_ptr + token * stride_t
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    cos = tl.load(cos_ptr + position * stride_cos + dims).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_sin + dims).to(tl.float32)
    if part < q_programs:
        heads = part * BLOCK_Q + tl.arange(0, BLOCK_Q)
        head_ok = heads < num_heads
        q = _rotated(row_ptr, heads, head_ok, stride_c, cos, sin, q_norm_ptr, eps,
                     HEAD_DIM, NORM, DTYPE, INTERPRETER)
        tl.store(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                 q.to(DTYPE), mask=head_ok[:, None])
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block * stride > 2**31
        if slot >= 0:
            heads = (part - q_programs) * BLOCK_KV + tl.arange(0, BLOCK_KV)
            head_ok = heads < num_kv_heads
            mask = head_ok[:, None]
            k = _rotated(row_ptr + num_heads * HEAD_DIM * stride_c, heads, head_ok, stride_c,
                         cos, sin, k_norm_ptr, eps, HEAD_DIM, NORM, DTYPE, INTERPRETER)
            v = tl.load(row_ptr + ((num_heads + num_kv_heads + heads[:, None]) * HEAD_DIM
                                   + dims[None, :]) * stride_c, mask=mask, other=0.0)
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            cache = (block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch
                     + dims[None, :] * stride_cd)
            if QUANT:
                scales = block * stride_sb + offset * stride_ss + heads * stride_sh
                k = _quantize_rows(k, key_scale_ptr, scales, head_ok)
                v = _quantize_rows(v.to(tl.float32), value_scale_ptr, scales, head_ok)
            tl.store(key_cache_ptr + cache, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(value_cache_ptr + cache, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# The token count changes every step: not specialized on (no recompiles for a new batch size).
@triton.jit(do_not_specialize=["num_tokens"])
def _silu_mul_kernel(
    x_ptr, out_ptr, num_tokens, size, stride_x, stride_o,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, DTYPE: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Program (row tile, column tile): out = silu(x[:, :size]) * x[:, size:]."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I))[None, :]
    mask = (rows < num_tokens) & (cols < size)
    gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(tl.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE, INTERPRETER)
    out = _round(silu * up, DTYPE, INTERPRETER)
    tl.store(out_ptr + rows * stride_o + cols, out.to(DTYPE), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] (rows may be strided, columns contiguous)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, None, out, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) of x, delta [T, H]: a residual add and the norm
    after it."""
    residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(residual)
    _launch_norm(x, delta, residual, out, weight, eps)
    return residual, out


def _launch_norm(x: torch.Tensor, delta: torch.Tensor | None, residual: torch.Tensor | None,
                 out: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    num_tokens, hidden = x.shape
    for t in (x, delta, residual, out):
        assert t is None or (t.shape == x.shape and t.dtype == x.dtype and t.stride(1) == 1)
    assert weight.shape == (hidden,) and weight.is_contiguous()
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    delta = x if delta is None else delta  # never read without ADD
    residual = out if residual is None else residual  # never written without ADD
    _rms_norm_kernel[(num_tokens,)](
        x, delta, residual, out, weight, hidden, eps,
        x.stride(0), delta.stride(0), residual.stride(0), out.stride(0),
        BLOCK=block, ADD=delta is not x, DTYPE=_DTYPES[x.dtype], INTERPRETER=interpreting(),
        num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False,
    )


def rotary_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, kv_cache: KVCache, layer: int, slot_mapping: torch.Tensor,
                 num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, eps: float = 0.0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The rotated q [T, num_heads, D] of qkv [T, (num_heads + 2 * num_kv_heads) * D]; the
    rotated k and v go into layer ``layer`` of the cache at ``slot_mapping`` [T] (-1: not
    stored). positions [T]: each token's row of cos, sin [max_positions, D]. ``q_norm``,
    ``k_norm`` [D] (both or neither): each head RMS-normed (``eps``) before the rotation."""
    values, scales = cache_parts(kv_cache)
    num_tokens = qkv.shape[0]
    head_dim = values.shape[5]
    block_size = values.shape[3]
    assert qkv.shape == (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    assert values.shape[4] == num_kv_heads, "the cache holds another number of KV heads"
    assert positions.shape == slot_mapping.shape == (num_tokens,)
    assert cos.shape == sin.shape and cos.shape[1] == head_dim
    assert cos.stride(1) == sin.stride(1) == 1 and cos.dtype == sin.dtype == qkv.dtype
    assert _is_power_of_two(head_dim) and _is_power_of_two(block_size)
    assert (q_norm is None) == (k_norm is None)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (num_tokens, num_heads, head_dim) and out.stride(2) == 1
    if num_tokens == 0:
        return out
    # Heads per program: tiles of about _ELEMENTS_PER_PROGRAM (Llama-3-8B: 8 query heads, so 4
    # query programs and 1 KV program a token).
    most = max(1, _ELEMENTS_PER_PROGRAM // head_dim)
    block_q = min(triton.next_power_of_2(num_heads), most)
    block_kv = min(triton.next_power_of_2(num_kv_heads), most)
    q_programs = triton.cdiv(num_heads, block_q)
    key_cache, value_cache = values[:, layer, 0], values[:, layer, 1]
    if scales is None:
        assert values.dtype == qkv.dtype
        key_scales = value_scales = values[:, layer, 0, :, :, 0]  # stand-ins, never read
    else:
        key_scales, value_scales = scales[:, layer, 0], scales[:, layer, 1]
    norm = q_norm is not None
    _rotary_store_kernel[(num_tokens, q_programs + triton.cdiv(num_kv_heads, block_kv))](
        qkv, positions, cos, sin, out, key_cache, value_cache, key_scales, value_scales,
        slot_mapping, q_norm if norm else cos, k_norm if norm else cos,
        num_heads, num_kv_heads, q_programs, eps,
        *qkv.stride(), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        *key_cache.stride(), *key_scales.stride(),
        BLOCK_Q=block_q, BLOCK_KV=block_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        NORM=norm, QUANT=scales is not None, DTYPE=_DTYPES[qkv.dtype],
        INTERPRETER=interpreting(), enable_fp_fusion=False,
    )
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] = [gate | up] (rows may be strided): [T, I]."""
    num_tokens, width = gate_up.shape
    size = width // 2
    assert width == 2 * size and gate_up.stride(1) == 1
    if out is None:
        out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, size) and out.dtype == gate_up.dtype and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block_i = min(triton.next_power_of_2(size), _ELEMENTS_PER_PROGRAM)
    block_t = 2  # decode steps mask half the rows; prefill gets 2-row tiles
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(size, block_i))
    _silu_mul_kernel[grid](
        gate_up, out, num_tokens, size, gate_up.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_I=block_i, DTYPE=_DTYPES[gate_up.dtype],
        INTERPRETER=interpreting(), enable_fp_fusion=False,
    )
    return out


def cache_parts(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache's values and, for an int8 cache, its scales (what the kernels take)."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.values, kv_cache.scales
    return kv_cache, None
