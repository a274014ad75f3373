"""The reference attention backend, and the CPU's: gather a sequence's blocks, then SDPA.

``prepare`` turns the step's flat metadata into work for SDPA once per step: decoding
sequences in batches of equal query length (one batched SDPA each, with the mask built here),
prefill chunks one by one (4-D SDPA: causal without a mask when the chunk is the whole
context so far, else a mask over its cached keys). A single decoding sequence needs no mask:
its keys are cut to its length.

An int8 cache (``QuantizedKV``) is quantized as the step's K/V are stored and dequantized as
blocks are gathered; a fresh prefill attends to its own K/V as stored (quantized and back), so
every path reads the same keys whether they came from the cache or not.

A layer's ``LayerAttention`` (Gemma) may ask for more: a query scale (SDPA's ``scale``), a
sliding window (the step's masks cut to each query's last ``window`` keys, made once a step per
window; a lone decoding sequence's keys are sliced instead) and logit soft-capping (SDPA cannot:
scores, ``tanh`` and softmax in float32 spelled out, as transformers' eager attention does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tandem.services.engine.attention.metadata import DecodeRows, RowPlan, StepMetadata
from tandem.services.engine.config import PLAIN_ATTENTION, LayerAttention
from tandem.services.engine.kv_cache import KVCache, QuantizedKV


@dataclass
class DecodeBatch:
    """``num_seqs`` sequences with ``query_len`` query rows each, from row ``start`` on.

    The mask repeats a sequence's rows for every query head of a KV group (the folding in
    ``TorchAttention``); with one query row it has a single row that broadcasts. None: one
    sequence with one query row, its keys cut to ``num_keys``.
    """

    start: int
    num_seqs: int
    query_len: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    mask: torch.Tensor | None  # [num_seqs, 1, heads_per_kv_group * query_len | 1, max_keys]
    num_keys: int
    # Keys and values read in place from the runner's rows (metadata.py), mask in row
    # order; None: gathered from the blocks.
    rows: RowPlan | None = None
    source: DecodeRows | None = None
    windowed: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.num_seqs * self.query_len

    def keys_and_mask(self, window: int | None) -> tuple[slice, torch.Tensor | None]:
        """The key positions a layer with ``window`` reads (None: all), and its mask."""
        if self.mask is None:  # one query row at position num_keys - 1: slice, no mask
            start = 0 if window is None else max(0, self.num_keys - window)
            return slice(start, self.num_keys), None
        if window is None:
            return slice(0, self.num_keys), self.mask
        if window not in self.windowed:
            self.windowed[window] = _windowed(self.mask, window)
        return slice(0, self.num_keys), self.windowed[window]


@dataclass
class PrefillSpan:
    """One sequence's chunk of query rows ``[start, end)`` attending to ``context_len`` keys."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks] covering context_len
    mask: torch.Tensor | None  # [q, context_len] bool; None = plain causal, no earlier context
    windowed: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with ``window`` (None: all keys; a None mask: plain causal)."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            causal = self.mask
            if causal is None:
                n = self.end - self.start
                causal = torch.ones(n, n, dtype=torch.bool, device=self.block_ids.device).tril()
            self.windowed[window] = _windowed(causal, window)
        return self.windowed[window]


@dataclass
class TorchPlan:
    slot_blocks: torch.Tensor  # [T] block id where each new token's k/v goes
    slot_offsets: torch.Tensor  # [T] offset inside that block
    decodes: list[Any]  # DecodeBatch here; a subclass's own kinds too (cpu_backend.py)
    prefills: list[Any]  # PrefillSpan here; likewise


class TorchAttention:
    name = "torch"

    def __init__(self, heads_per_kv_group: int) -> None:
        self.group = heads_per_kv_group

    def prepare(self, step: StepMetadata) -> TorchPlan:
        bs = step.block_size
        starts = [0]
        for q in step.query_lens_host:
            starts.append(starts[-1] + q)
        decodes: list[DecodeBatch] = []
        s = 0
        while s < step.num_decodes:  # runs of equal query length
            e = s
            while e < step.num_decodes and step.query_lens_host[e] == step.query_lens_host[s]:
                e += 1
            decodes.append(self._plan_decodes(step, s, e, starts[s]))
            s = e
        return TorchPlan(step.slot_mapping // bs, step.slot_mapping % bs, decodes,
                         self._plan_prefills(step, starts))

    def _plan_prefills(self, step: StepMetadata, starts: list[int]) -> list[Any]:
        """The plan of the step's prefill chunks (sequences ``num_decodes`` on; sequence i's
        rows from ``starts[i]``); ``_prefill`` runs it."""
        bs, device = step.block_size, step.slot_mapping.device
        prefills: list[Any] = []
        for s in range(step.num_decodes, step.num_seqs):
            q, n = step.query_lens_host[s], step.seq_lens_host[s]
            if q == n:
                prefills.append(PrefillSpan(starts[s], starts[s] + q, n,
                                            step.block_tables[s, :0], None))
                continue
            key_pos = torch.arange(n, device=device)
            mask = key_pos[None, :] <= torch.arange(n - q, n, device=device)[:, None]
            prefills.append(PrefillSpan(starts[s], starts[s] + q, n,
                                        step.block_tables[s, :-(-n // bs)], mask))
        return prefills

    def _plan_decodes(self, step: StepMetadata, s: int, e: int, row: int) -> Any:
        """The plan of decoding sequences ``s .. e-1`` (equal query lengths), rows from
        ``row`` on; ``_decode`` runs it."""
        return self._with_rows(step, s, e, self._decode_batch(step, s, e, row))

    def _decode_batch(self, step: StepMetadata, s: int, e: int, row: int) -> DecodeBatch:
        bs, device = step.block_size, step.slot_mapping.device
        length = step.query_lens_host[s]
        lens = step.seq_lens_host[s:e]
        width = -(-max(lens) // bs)
        tables = step.block_tables[s:e, :width]
        if e - s == 1 and length == 1:
            return DecodeBatch(row, 1, 1, tables, None, lens[0])
        key_pos = torch.arange(width * bs, device=device)
        # Query row i of a sequence sits at position seq_len - length + i; it sees keys up to it.
        query_pos = (step.seq_lens[s:e, None] - length
                     + torch.arange(length, device=device)[None, :])  # [n, length]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [n, length, keys]
        if length > 1:
            mask = mask[:, None].expand(-1, self.group, -1, -1)
        mask = mask.reshape(e - s, 1, -1, key_pos.numel())
        return DecodeBatch(row, e - s, length, tables, mask, width * bs)

    def _with_rows(self, step: StepMetadata, s: int, e: int, batch: DecodeBatch
                   ) -> DecodeBatch:
        """The batch reading the runner's decode rows, when it has them (one query row each)."""
        if step.decode_rows is None or step.seq_keys is None or batch.query_len != 1:
            return batch
        rows = step.decode_rows.arrange(step.seq_keys[s:e], step.seq_lens_host[s:e],
                                        batch.block_tables)
        if rows is None:
            return batch
        mask = None if batch.mask is None else batch.mask.index_select(0, rows.order)
        return dataclasses.replace(batch, mask=mask, rows=rows, source=step.decode_rows)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, plan: TorchPlan, attn: LayerAttention = PLAIN_ATTENTION
                ) -> torch.Tensor:
        """Write k/v for the step's tokens into the cache, return attention output [T, Hq*D]
        (computed as the layer's ``attn`` says)."""
        num_tokens, num_heads, head_dim = q.shape
        k, v = self._store(layer, k, v, kv_cache, plan)
        out = torch.empty_like(q)
        for batch in plan.decodes:
            self._decode(layer, q, k, v, kv_cache, batch, out[batch.start:batch.end], attn)
        self._prefill(layer, q, k, v, kv_cache, plan.prefills, out, attn)
        return out.view(num_tokens, num_heads * head_dim)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               plan: TorchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's k/v into the cache; the k/v its attention reads (an int8 cache's are
        quantized and back)."""
        if isinstance(kv_cache, QuantizedKV):
            return kv_cache.store(layer, k, v, plan.slot_blocks, plan.slot_offsets)
        kv_cache[:, layer, 0][plan.slot_blocks, plan.slot_offsets] = k
        kv_cache[:, layer, 1][plan.slot_blocks, plan.slot_offsets] = v
        return k, v

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: KVCache, prefills: list[Any], out: torch.Tensor,
                 attn: LayerAttention = PLAIN_ATTENTION) -> None:
        """The prefill chunks' attention into their rows of ``out``."""
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        for span in prefills:
            mask = span.mask_for(attn.sliding_window)
            q_span = q[span.start:span.end].transpose(0, 1)[None]  # [1, Hq, len, D]
            if span.mask is None:
                keys = k[span.start:span.end]
                values = v[span.start:span.end]
            else:
                keys = _gather(kv_cache, layer, 0, span.block_ids, q.dtype).view(
                    -1, num_kv_heads, head_dim)
                values = _gather(kv_cache, layer, 1, span.block_ids, q.dtype).view(
                    -1, num_kv_heads, head_dim)
                keys, values = keys[:span.context_len], values[:span.context_len]
            # 4-D: SDPA's fused kernels take only batched inputs (3-D falls back to math).
            result = _attention(q_span, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                mask, attn, is_causal=mask is None,
                                enable_gqa=num_heads != num_kv_heads)
            out[span.start:span.end] = result[0].transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, batch: Any, out: torch.Tensor,
                attn: LayerAttention = PLAIN_ATTENTION) -> None:
        """The attention output of one decode batch's query rows into ``out`` (its rows)."""
        out.copy_(self._decode_batch_output(layer, q, k, v, kv_cache, batch, attn))

    def _decode_batch_output(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, kv_cache: KVCache, batch: DecodeBatch,
                             attn: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        if batch.rows is not None and batch.source is not None:
            return _attend_rows(q, k, v, layer, batch, batch.rows, batch.source, attn)
        n, length = batch.num_seqs, batch.query_len
        # Gathering k and v separately leaves each contiguous: the reshape and transpose
        # below are views, and SDPA reads the strided layout without another copy.
        table = batch.block_tables.flatten()
        keys = _gather(kv_cache, layer, 0, table, q.dtype).view(n, -1, num_kv_heads,
                                                                 head_dim)
        values = _gather(kv_cache, layer, 1, table, q.dtype).view(n, -1, num_kv_heads,
                                                                   head_dim)
        span, mask = batch.keys_and_mask(attn.sliding_window)
        if batch.mask is None:  # one sequence: its keys, no mask
            keys, values = keys[:, span], values[:, span]
        # Fold each KV group's query heads (and query rows) into the query-length dim:
        # one matmul per KV head instead of one per query head.
        group_q = (q[batch.start:batch.end].view(n, length, num_kv_heads, group, head_dim)
                   .permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group * length, head_dim))
        result = _attention(group_q, keys.transpose(1, 2), values.transpose(1, 2), mask, attn)
        return (result.view(n, num_kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
                .reshape(n * length, num_heads, head_dim))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               attn: LayerAttention, is_causal: bool = False, enable_gqa: bool = False
               ) -> torch.Tensor:
    """SDPA of 4-D q [B, Hq, Lq, D] over k/v [B, Hkv, Lk, D] (``mask`` True where a query sees
    a key), scaled as ``attn`` says; soft-capped scores spelled out, as transformers' eager
    attention computes them (SDPA has no capping)."""
    if attn.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=attn.scale, enable_gqa=enable_gqa)
    if k.shape[1] != q.shape[1]:  # query head h reads KV head h // group
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if attn.scale is None else attn.scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / attn.softcap) * attn.softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def _windowed(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal ``mask`` (each row True on keys ``0 .. p``, its query at position p) cut to
    each row's last ``window`` keys: ``p - window < key <= p``."""
    position = mask.sum(-1, keepdim=True) - 1
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (keys > position - window)


def _gather(kv_cache: KVCache, layer: int, kv: int, blocks: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``blocks`` of the layer's keys (kv 0) or values (1): [n, block_size, Hkv, D]."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.gather(layer, kv, blocks, dtype)
    # index_select, not advanced indexing: ~25x faster on this strided view on CPU.
    return kv_cache[:, layer, kv].index_select(0, blocks)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 batch: DecodeBatch, rows: RowPlan, source: DecodeRows,
                 attn: LayerAttention = PLAIN_ATTENTION) -> torch.Tensor:
    """A one-query-row decode batch against its rows: the new k/v go into the rows, SDPA reads
    rows ``0 .. n-1`` in place (queries permuted into row order and back)."""
    n, (num_heads, head_dim) = batch.num_seqs, q.shape[1:]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    span = slice(batch.start, batch.end)
    source.data[layer, 0, rows.rows, rows.positions] = k[span]
    source.data[layer, 1, rows.rows, rows.positions] = v[span]
    positions, mask = batch.keys_and_mask(attn.sliding_window)
    keys = source.data[layer, 0, :n, positions]  # [n, keys, Hkv, D]
    values = source.data[layer, 1, :n, positions]
    group_q = q[span].index_select(0, rows.order).view(n, num_kv_heads, group, head_dim)
    result = _attention(group_q, keys.transpose(1, 2), values.transpose(1, 2), mask, attn)
    return result.reshape(n, num_heads, head_dim).index_select(0, rows.rows)
