"""Paged attention over the block-major KV cache.

The model runner builds one ``AttentionMetadata`` per step; every layer reuses it. Rows of the
step's flat token batch are ordered: single-token queries (decodes) first, then prefill chunks.
``TorchAttention`` is the reference and the CPU backend: gather a sequence's blocks, then
``scaled_dot_product_attention``. Other backends (flash-attn, Triton) implement the same call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence's chunk of query rows ``[start, end)`` attending to ``context_len`` keys."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks] covering context_len
    mask: torch.Tensor | None  # [q, context_len] bool; None = plain causal, no earlier context


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id where each new token's k/v goes
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decodes: int  # rows [0, num_decodes) are single-token queries
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan]


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write k/v for the step's tokens into the cache, return attention output [T, Hq*D]."""
        ...


class TorchAttention:
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        layer_cache = kv_cache[:, layer]  # [blocks, 2, block_size, Hkv, D] (a view)
        layer_cache[meta.slot_blocks, 0, meta.slot_offsets] = k
        layer_cache[meta.slot_blocks, 1, meta.slot_offsets] = v

        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            assert meta.decode_block_tables is not None and meta.decode_mask is not None
            kv = layer_cache[meta.decode_block_tables]  # [n, max_blocks, 2, bs, Hkv, D]
            keys = kv[:, :, 0].reshape(n, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = kv[:, :, 1].reshape(n, -1, num_kv_heads, head_dim).transpose(1, 2)
            # Fold each KV group's query heads into the query-length dim: one matmul per group.
            group_q = q[:n].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
            attn = F.scaled_dot_product_attention(group_q, keys, values,
                                                  attn_mask=meta.decode_mask)
            out[:n] = attn.reshape(n, num_heads, head_dim)

        for span in meta.prefills:
            q_span = q[span.start:span.end].transpose(0, 1)  # [Hq, len, D]
            if span.mask is None:
                keys = k[span.start:span.end].transpose(0, 1)
                values = v[span.start:span.end].transpose(0, 1)
            else:
                kv = layer_cache[span.block_ids]  # [nb, 2, bs, Hkv, D]
                keys = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:span.context_len]
                values = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:span.context_len]
                keys, values = keys.transpose(0, 1), values.transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q_span, keys, values, attn_mask=span.mask, is_causal=span.mask is None,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[span.start:span.end] = attn.transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r}; available: torch")
