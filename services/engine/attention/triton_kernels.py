"""Triton kernels over the paged KV cache: ``store_kv`` and ``paged_attention``.

The cache is ``[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]``. Kernels
get one layer's key and value views with their strides; key position ``j`` of sequence ``s`` is
read in place at block ``block_tables[s, j // block_size]``, slot ``j % block_size``.

``paged_attention`` is one kernel for decode, speculative verification and (chunked) prefill.
A program owns (one query tile of one sequence, one KV head, one key split). Its M dimension
folds the KV head's ``group`` query heads with ``BLOCK_Q`` query rows (tile row ``r`` is query
row ``r // group``, head ``r % group`` of the group), so each K/V tile is loaded once per KV head.
Keys are visited in ``BLOCK_N`` tiles (any size: every key looks up its own block id) up to
the tile's last query position, with an fp32 online softmax in the exp2 domain.
Query tiles are numbered flat over the step, sequence ``s`` starting at tile
``query_start[s] // BLOCK_Q + s`` (found by binary search), so a step of many decodes plus one
long prefill launches about ``T / BLOCK_Q + S`` programs per KV head, not ``S x`` the longest query.

An int8 cache (``scales`` given: float32 ``[num_blocks, num_layers, 2, block_size, num_kv_heads]``)
is quantized by ``store_kv`` (a scale per token and KV head, absmax / 127, rounded half away from
zero as ``kv_cache.quantize_int8``) and read as int8 by the attention kernel, which turns the
tile to q's dtype (int8 is exact in bfloat16) and applies the scales to the scores (keys) and
to the probabilities (values), one multiply per key instead of one per element.

Split-KV (``num_splits > 1``): each program's key range is cut into ``num_splits`` tile-aligned
parts whose (max, sum, unnormalised acc) go to fp32 scratch; ``_reduce_splits_kernel`` merges them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = math.log2(math.e)
# Split-KV: a decode step of few sequences has too few (sequence, KV head) programs to keep an
# H200's memory busy (batch 1 over 8k keys: 0.20 ms with 16 splits of 512 keys, 580 GB/s).
# Splits go up to 64 of one 64-key tile or more, until there are two programs per SM.
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 64
_PROGRAMS_PER_SM = 2
_MAX_DECODE_QUERY_LEN = 16  # longer queries (prefill chunks) bring enough programs of their own
# Shared memory a tile plan may count on (q's tile plus K/V tiles in flight, by launch_config's
# estimate, which runs above what Triton allocates): under sm_90's 227 KB.
_SHARED_BUDGET = 200 * 1024


@triton.jit
def _quantize_rows(x, scale_ptr, scale_offsets, row_ok):
    """int8 rows of x [HEADS, HEAD_DIM] (float32); stores each row's scale."""
    # IEEE divisions (div_rn), as torch's: Triton's ``/`` on float32 is an approximate
    # division on a GPU, which moves values across a rounding midpoint now and then.
    scale = tl.div_rn(tl.max(tl.abs(x), 1), 127.0)
    tl.store(scale_ptr + scale_offsets, scale, mask=row_ok)
    scaled = tl.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    rounded = tl.where(scaled >= 0, scaled + 0.5, scaled - 0.5)  # .to(int8) truncates
    return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    slot_mapping_ptr, num_kv_heads,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] key and value into its slot
    (none for slot -1: a CUDA graph's padding row); QUANT: as int8 rows plus their scales."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block * stride can pass 2**31
    if slot < 0:
        return
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < num_kv_heads
    cache = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
             + heads * stride_ch + dims * stride_cd)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    if QUANT:
        head_ids = tl.arange(0, HEADS)
        scales = ((slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_ss
                  + head_ids * stride_sh)
        head_ok = head_ids < num_kv_heads
        k = _quantize_rows(k.to(tl.float32), key_scale_ptr, scales, head_ok)
        v = _quantize_rows(v.to(tl.float32), value_scale_ptr, scales, head_ok)
    tl.store(key_cache_ptr + cache, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_key_tile(
    q, m_i, l_i, acc, start, kv_hi, positions, block_table, key_cache_ptr, value_cache_ptr,
    key_scale_ptr, value_scale_ptr,
    qk_scale, stride_cb, stride_cs, stride_cd, stride_bb, stride_sb, stride_ss,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N) (those below kv_hi).
    Not MASKED: every key of the tile is below kv_hi and visible to every row."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = (keys < kv_hi) if MASKED else tl.full([BLOCK_N], True, tl.int1)
    blocks = tl.load(block_table + (keys // BLOCK_SIZE) * stride_bb, mask=key_ok, other=0)
    offsets = blocks.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_cs
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(key_cache_ptr + offsets[None, :] + dims[:, None] * stride_cd,
                mask=key_ok[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]: K transposed
    v = tl.load(value_cache_ptr + offsets[:, None] + dims[None, :] * stride_cd,
                mask=key_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    if INTERPRETER:  # it computes bfloat16 on the raw bit patterns: work in float32
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if QUANT:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scale_offsets = blocks.to(tl.int64) * stride_sb + (keys % BLOCK_SIZE) * stride_ss
        key_scales = tl.load(key_scale_ptr + scale_offsets, mask=key_ok, other=0.0)
        value_scales = tl.load(value_scale_ptr + scale_offsets, mask=key_ok, other=0.0)

    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if QUANT:
        scores = scores * key_scales[None, :]
    if MASKED:
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row with no visible key yet keeps max -inf; subtract 0 instead (exp2(-inf) = 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        p = p * value_scales[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Values that change from step to step are not specialized on (Triton would otherwise compile a
# variant for 1, for multiples of 16 and for the rest: seconds on the engine thread mid-serving).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_bs"])
def _paged_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, out_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr,
    query_start_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, num_tokens, num_heads, num_splits, qk_scale,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_bs, stride_bb,
    stride_sb, stride_ss, stride_sh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    INTERPRETER: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Binary search for the sequence owning this tile: the last s whose first tile,
    # query_start[s] // BLOCK_Q + s, is <= tile. (Inline: the interpreter pays per call.)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_tile_start = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= q_len:
        return  # a spare tile between two sequences' tiles
    context_len = tl.load(seq_lens_ptr + seq) - q_len  # position of the first query row

    rows = tl.arange(0, BLOCK_M)
    q_rows = q_tile_start + rows // GROUP  # query row within the sequence
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_rows < q_len)
    positions = context_len + q_rows
    tokens = q_start + q_rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    if INTERPRETER:
        q = q.to(tl.float32)

    # This split's keys: the keys up to the tile's last query row, in num_splits tile-aligned
    # parts (a part may be empty; it then reports max -inf and sum 0).
    kv_end = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits)
    kv_lo = split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_lo + tiles_per_split * BLOCK_N, kv_end)

    block_table = block_tables_ptr + seq * stride_bs
    key_cache_ptr += kv_head * stride_ch
    value_cache_ptr += kv_head * stride_ch
    if QUANT:
        key_scale_ptr += kv_head * stride_sh
        value_scale_ptr += kv_head * stride_sh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys before the tile's first query position are visible to every row: whole tiles of
    # them skip the bounds and causal masks; the tiles from there to kv_hi keep both.
    diagonal = tl.maximum(kv_lo, tl.minimum(kv_hi, (context_len + q_tile_start)
                                            // BLOCK_N * BLOCK_N))
    if INTERPRETER:
        # The interpreter's range() cannot take tensor bounds with numpy >= 2.4 (triton#9171);
        # on the GPU the for loops below are what the software pipeliner works on.
        start = kv_lo
        while start < kv_hi:
            m_i, l_i, acc = _attend_key_tile(
                q, m_i, l_i, acc, start, kv_hi, positions, block_table, key_cache_ptr,
                value_cache_ptr, key_scale_ptr, value_scale_ptr, qk_scale, stride_cb,
                stride_cs, stride_cd, stride_bb, stride_sb, stride_ss,
                BLOCK_N, HEAD_DIM, BLOCK_SIZE, INTERPRETER, DOT_PRECISION, QUANT,
                start >= diagonal)
            start += BLOCK_N
    else:
        for start in range(kv_lo, diagonal, BLOCK_N):
            m_i, l_i, acc = _attend_key_tile(
                q, m_i, l_i, acc, start, kv_hi, positions, block_table, key_cache_ptr,
                value_cache_ptr, key_scale_ptr, value_scale_ptr, qk_scale, stride_cb,
                stride_cs, stride_cd, stride_bb, stride_sb, stride_ss,
                BLOCK_N, HEAD_DIM, BLOCK_SIZE, INTERPRETER, DOT_PRECISION, QUANT, False)
        for start in range(diagonal, kv_hi, BLOCK_N):
            m_i, l_i, acc = _attend_key_tile(
                q, m_i, l_i, acc, start, kv_hi, positions, block_table, key_cache_ptr,
                value_cache_ptr, key_scale_ptr, value_scale_ptr, qk_scale, stride_cb,
                stride_cs, stride_cd, stride_bb, stride_sb, stride_ss,
                BLOCK_N, HEAD_DIM, BLOCK_SIZE, INTERPRETER, DOT_PRECISION, QUANT, True)

    if SPLIT:
        part = (split * num_tokens + tokens) * num_heads + heads
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])
    else:
        # Every row sees key 0 in the one split, so l_i > 0.
        out = acc / l_i[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _reduce_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, num_tokens, num_heads, num_splits,
    stride_ot, stride_oh, stride_od,
    SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One program per (token, BLOCK_H query heads): merge the splits' partial softmaxes."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    heads = tl.minimum(heads, num_heads - 1)  # padding lanes redo the last head, never stored
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    part = (splits[:, None] * num_tokens + token) * num_heads + heads[None, :]  # [SPLITS, H]
    split_ok = splits[:, None] < num_splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    total = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                  mask=split_ok[:, :, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, 0)[None, :])  # split 0 always holds key 0: the max is finite
    out = tl.sum(acc * weight[:, :, None], 0) / tl.sum(total * weight, 0)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def store_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Write k, v [T, num_kv_heads, head_dim] of the step's T new tokens into layer `layer` of
    the cache: token t goes to block slot_mapping[t] // block_size, offset
    slot_mapping[t] % block_size; a slot of -1 is skipped. slot_mapping: [T] int64 (or int32).
    ``scales`` (an int8 cache's): each token's rows are quantized, their scales stored there."""
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = kv_cache.shape[3]
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert kv_cache.shape[4:] == (num_kv_heads, head_dim), "k does not match the cache's heads"
    assert _is_power_of_two(head_dim) and _is_power_of_two(block_size)
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    key_scales, value_scales = _layer_scales(kv_cache, layer, scales)
    _store_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, key_scales, value_scales, slot_mapping, num_kv_heads,
        *k.stride(), *v.stride(), *key_cache.stride(), *key_scales.stride(),
        BLOCK_SIZE=block_size, HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        QUANT=scales is not None,
    )


def _layer_scales(kv_cache: torch.Tensor, layer: int, scales: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's key and value scales [num_blocks, block_size, num_kv_heads]; without an
    int8 cache, stand-ins of that rank (never read: QUANT is a compile-time False)."""
    if scales is None:
        assert kv_cache.is_floating_point()
        stand_in = kv_cache[:, layer, 0, :, :, 0]
        return stand_in, stand_in
    assert kv_cache.dtype == torch.int8 and scales.shape == kv_cache.shape[:-1]
    return scales[:, layer, 0], scales[:, layer, 1]


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    max_query_len: int, max_seq_len: int, scale: float,
                    num_splits: int = 1, out: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None,
                    config: LaunchConfig | None = None) -> torch.Tensor:
    """Attention of every query row of the step over its sequence's cached keys, reading K/V
    in place from the block table (no gather copy). Returns [T, num_heads, head_dim] in q's
    dtype.

    Sequence s owns query rows query_start[s]:query_start[s + 1]; its row i sits at position
    seq_lens[s] - q_len + i and attends to key positions <= that. max_query_len and max_seq_len
    are host-side maxima so the launch never syncs with the device; they only pick tile sizes
    and cap num_splits (at the number of key tiles), so results never depend on them.
    num_splits == 1 allocates no scratch. ``scales``: an int8 cache's (see ``store_kv``).
    ``config``: tile sizes and warps (default ``launch_config``'s; ``gpu_check`` tries others).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    num_seqs = seq_lens.shape[0]
    assert kv_cache.shape[5] == head_dim
    assert kv_cache.dtype == (torch.int8 if scales is not None else q.dtype)
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of the KV heads"
    assert _is_power_of_two(head_dim) and _is_power_of_two(block_size)
    assert query_start.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    config = config or launch_config(group, max_query_len, head_dim, q.element_size())
    block_m, block_n = config.block_m, config.block_n
    assert block_m >= max(16, group) and block_n >= 16
    block_q = block_m // group
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, block_n)))

    if num_splits > 1:
        part_max = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_splits, num_tokens, num_heads, head_dim),
                               dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # never read: SPLIT is a compile-time False

    key_cache, value_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    key_scales, value_scales = _layer_scales(kv_cache, layer, scales)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, key_cache, value_cache, key_scales, value_scales, out, part_max, part_sum, part_acc,
        query_start, seq_lens, block_tables,
        num_seqs, num_tokens, num_heads, num_splits, scale * _LOG2E,
        *q.stride(), *out.stride(), *key_cache.stride(), *block_tables.stride(),
        *key_scales.stride(),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, SPLIT=num_splits > 1, QUANT=scales is not None,
        INTERPRETER=interpreting(),
        # float32 caches (tests, debugging) get exact products, not TF32 tensor-core ones.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        # One variant for every split count (a constexpr per count would compile mid-serving):
        # _MAX_SPLITS rows, those past num_splits masked off. A head per program.
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_max, part_sum, part_acc, num_tokens, num_heads, num_splits,
            *out.stride(), SPLITS=_MAX_SPLITS, BLOCK_H=1, HEAD_DIM=head_dim,
            num_warps=4 if head_dim <= 128 else 8,
        )
    return out


@dataclass(frozen=True)
class LaunchConfig:
    """How ``paged_attention`` tiles a step."""

    block_m: int  # tile rows: query rows x the KV head's query heads (rows past a multiple idle)
    block_n: int  # keys per inner step: any multiple of 16 (each key looks up its own block)
    num_warps: int
    num_stages: int  # software-pipelined K/V loads in flight


def launch_config(group: int, max_query_len: int, head_dim: int,
                  element_size: int = 2) -> LaunchConfig:
    """Tiles for a step: 16 rows while every sequence decodes (or verifies a few drafts: one
    query row x the group's heads fills them), 64 once prefill chunks are present, with 4
    warps (one sm_90 warpgroup: 8 warps over 64 rows would split each product, not share it).
    Keys go 64 at a time whatever the cache's block size. Wide heads and float32 take fewer
    stages, then narrower tiles, until q's tile and the K/V tiles in flight fit an sm_90
    block's shared memory (``tests/engine/test_triton_gpu_budgets.py`` compiles each).
    Measured on an H200 (``gpu_check --sections sweep``): docs/operations.md, GPU check."""
    decode = group * max_query_len <= 16
    least_m = max(16, triton.next_power_of_2(group))
    block_m, block_n, stages = max(16 if decode else 64, least_m), 64, 3

    def shared() -> int:
        return (block_m + 2 * stages * block_n) * head_dim * element_size

    while shared() > _SHARED_BUDGET and stages > 2:
        stages -= 1
    while shared() > _SHARED_BUDGET and block_n > 16:
        block_n //= 2
    while shared() > _SHARED_BUDGET and block_m > least_m:
        block_m //= 2
    return LaunchConfig(block_m, block_n, 4 if block_m <= 64 else 8, stages)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_sms: int = 132) -> int:
    """Key splits for a step: double while the (sequence, KV head) programs number fewer than
    _PROGRAMS_PER_SM per SM and every split keeps at least _MIN_KEYS_PER_SPLIT keys. 1 for
    prefill-sized queries."""
    if max_query_len > _MAX_DECODE_QUERY_LEN:
        return 1
    programs = num_seqs * num_kv_heads
    splits = 1
    while (splits < _MAX_SPLITS and programs * splits < _PROGRAMS_PER_SM * num_sms
           and max_seq_len // (2 * splits) >= _MIN_KEYS_PER_SPLIT):
        splits *= 2
    return splits


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (CPU tensors; tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
