"""flash-attn's paged kernel (the ``flash_attn`` package, CUDA only) behind our interface.

One ``flash_attn_varlen_func`` call per layer covers the whole step, decodes and prefill chunks
alike: it reads K/V in place through the block table, and its causal mask is aligned to the
bottom right of each sequence's (query, key) matrix, which is our rule (query row ``i`` of a
sequence with ``q`` rows and ``n`` keys sits at position ``n - q + i``). The KV write is ours,
before the call.

flash-attn 2 takes pages of a multiple of 256 tokens (``FLASH_ATTN_BLOCK_MULTIPLE``), so this
backend needs ``block_size`` to be one: ``tandem up --attention-backend flash_attn`` picks 256
unless told otherwise, and an engine config asking for flash_attn with other blocks is refused.
Coarser blocks mean coarser prefix-cache hits and KV transfers; the triton backend has no such
constraint. Decode steps run eagerly (CUDA graphs are captured for the triton backend only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.services.engine.attention.metadata import StepMetadata
from tandem.services.engine.config import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    PLAIN_ATTENTION,
    LayerAttention,
)
from tandem.services.engine.kv_cache import KVCache, QuantizedKV

VarlenFunc = Callable[..., torch.Tensor]


def import_flash_attn() -> VarlenFunc:
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    varlen: VarlenFunc = flash_attn_varlen_func
    return varlen


@dataclass
class FlashPlan:
    step: StepMetadata
    slot_blocks: torch.Tensor  # [T] the block each new token's k/v goes to
    slot_offsets: torch.Tensor  # [T] its offset in that block
    cu_seqlens_k: torch.Tensor  # [S + 1] int32: cumulative key counts


class FlashAttention:
    name = "flash_attn"

    def __init__(self, head_dim: int, varlen_func: VarlenFunc | None = None) -> None:
        self.scale = head_dim ** -0.5
        self.varlen = varlen_func if varlen_func is not None else import_flash_attn()

    def prepare(self, step: StepMetadata) -> FlashPlan:
        if step.block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ValueError(f"attention_backend flash_attn needs block_size to be a multiple "
                             f"of {FLASH_ATTN_BLOCK_MULTIPLE}, got {step.block_size}")
        cu_seqlens_k = F.pad(step.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return FlashPlan(step, step.slot_mapping // step.block_size,
                         step.slot_mapping % step.block_size, cu_seqlens_k)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, plan: FlashPlan, attn: LayerAttention = PLAIN_ATTENTION
                ) -> torch.Tensor:
        if isinstance(kv_cache, QuantizedKV):
            raise ValueError("attention_backend flash_attn cannot read an int8 KV cache "
                             "(kv_cache_dtype int8): use attention_backend triton or torch")
        step = plan.step
        key_cache = kv_cache[:, layer, 0]  # [blocks, block_size, Hkv, D]: strided views
        value_cache = kv_cache[:, layer, 1]
        key_cache[plan.slot_blocks, plan.slot_offsets] = k
        value_cache[plan.slot_blocks, plan.slot_offsets] = v
        kwargs: dict[str, Any] = {
            "cu_seqlens_q": step.query_start, "cu_seqlens_k": plan.cu_seqlens_k,
            "max_seqlen_q": step.max_query_len, "max_seqlen_k": step.max_seq_len,
            "softmax_scale": self.scale, "causal": True, "block_table": step.block_tables,
        }
        out = self.varlen(q, key_cache, value_cache, **kwargs)
        return out.reshape(q.shape[0], -1)
