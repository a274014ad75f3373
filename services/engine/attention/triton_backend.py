"""Our Triton paged attention: K/V read in place from the block table, no gather, no mask.

``prepare`` only picks the split-KV factor for the step (from host numbers, no sync); each
layer stores its new K/V (``store_kv``) and runs one kernel launch over every sequence of the
step, decoding or prefilling (``paged_attention``; kernels in ``triton_kernels.py``). The
model's own path for this backend stores K/V with the rotary embedding
(``triton_ops.rotary_store``) and calls ``attend``, the attention alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.services.engine.attention.metadata import StepMetadata
from tandem.services.engine.attention.triton_kernels import (
    choose_num_splits,
    paged_attention,
    store_kv,
)
from tandem.services.engine.attention.triton_ops import cache_parts
from tandem.services.engine.config import PLAIN_ATTENTION, LayerAttention
from tandem.services.engine.kv_cache import KVCache


@dataclass
class TritonPlan:
    step: StepMetadata
    num_splits: int


class TritonAttention:
    name = "triton"

    def __init__(self, num_kv_heads: int, head_dim: int, device: str) -> None:
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim ** -0.5
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if torch.device(device).type == "cuda" else 132)

    def prepare(self, step: StepMetadata) -> TritonPlan:
        return TritonPlan(step, choose_num_splits(step.num_seqs, self.num_kv_heads,
                                                  step.max_query_len, step.max_seq_len,
                                                  self.num_sms))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, plan: TritonPlan, attn: LayerAttention = PLAIN_ATTENTION
                ) -> torch.Tensor:
        values, scales = cache_parts(kv_cache)
        store_kv(values, layer, k, v, plan.step.slot_mapping, scales)
        return self.attend(layer, q, kv_cache, plan)

    def attend(self, layer: int, q: torch.Tensor, kv_cache: KVCache,
               plan: TritonPlan) -> torch.Tensor:
        """``forward`` without the store: the attention of q [T, Hq, D] over the cache, whose
        K/V for the step's tokens are in place already; [T, Hq * D]."""
        step = plan.step
        values, scales = cache_parts(kv_cache)
        out = paged_attention(q, values, layer, step.query_start, step.seq_lens,
                              step.block_tables, step.max_query_len, step.max_seq_len,
                              self.scale, num_splits=plan.num_splits, scales=scales)
        return out.view(q.shape[0], -1)
