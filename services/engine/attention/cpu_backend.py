"""The ``cpu`` backend: decoding sequences through our C kernel, reading K/V in place.

For a bfloat16 cache on an x86 CPU with AVX-512 BF16, or a float32 cache on one with AVX2 and FMA
(``cpu_kernels.py``: ``decode_attention_f32.c``, decode only: a float32 cache's stores and
prefill chunks go through the torch backend's code). Each run of decoding
sequences with the same query length (one row, or one plus draft tokens) is one kernel call
over the block tables: no gather, no mask, no per-step copy of the contexts (the torch
backend's decode rows, DecodeRows, are not kept). A step's prefill chunks are one call of the AMX
prefill kernel (csrc/prefill_attention.c, where the CPU has AMX): K/V read through the block
tables too, cached prefix or not, no mask built. Shapes the kernels do not take go through the
torch backend's SDPA. A layer's new K/V go into the cache in one kernel call as well.

The kernel rounds differently from SDPA (bfloat16 dot products, its own exp), so bfloat16
greedy outputs can differ from the torch backend's after some tokens; every path through this
backend (colocated, disaggregated, speculative, migrated) decodes with the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention.metadata import StepMetadata
from tandem.services.engine.attention.torch_backend import TorchAttention, TorchPlan
from tandem.services.engine.config import PLAIN_ATTENTION, LayerAttention
from tandem.services.engine.kv_cache import KVCache


@dataclass
class KernelPrefill:
    """The step's prefill chunks, one kernel call: ``spans`` [3, n] int64 (each chunk's first
    row, its query rows, its keys), ``block_tables`` [n, max_blocks] int32."""

    spans: torch.Tensor
    block_tables: torch.Tensor


@dataclass
class KernelBatch:
    """Decoding sequences whose ``query_len`` rows each start at row ``start``."""

    start: int
    end: int
    query_len: int
    block_tables: torch.Tensor  # [n, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor  # [n] int32


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self, heads_per_kv_group: int, num_kv_heads: int, head_dim: int,
                 threads: int = 1, dtype: torch.dtype = torch.bfloat16) -> None:
        """``threads``: 2 lets the kernels' helper thread take part of each call; ``dtype``:
        the cache's, bfloat16 or float32."""
        super().__init__(heads_per_kv_group)
        self.threads = threads
        self.float32 = dtype == torch.float32
        self.kernels = None if self.float32 else cpu_kernels.load()  # the bfloat16 library
        self.decode_kernel: cpu_kernels.Kernels | cpu_kernels.Float32Kernels = (
            self.kernels if self.kernels is not None else cpu_kernels.load_f32())
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        # Prefill chunks through our AMX kernel where it runs, else SDPA.
        self.prefill_kernel = (self.kernels is not None and self.kernels.amx
                               and cpu_kernels.supports_prefill(head_dim))

    def _plan_decodes(self, step: StepMetadata, s: int, e: int, row: int) -> Any:
        length = step.query_lens_host[s]
        if not cpu_kernels.supports_decode(self.num_kv_heads, self.head_dim, self.group, length,
                                           self.float32):
            return super()._plan_decodes(step, s, e, row)
        return KernelBatch(row, row + (e - s) * length, length, step.block_tables[s:e],
                           step.seq_lens[s:e])

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               plan: TorchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is None:  # float32: torch's indexed store
            return super()._store(layer, k, v, kv_cache, plan)
        assert isinstance(kv_cache, torch.Tensor)  # resolve_backend refuses int8
        self.kernels.store_kv(k, v, kv_cache[:, layer, 0], kv_cache[:, layer, 1],
                              plan.slot_blocks, plan.slot_offsets)
        return k, v

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, batch: Any, out: torch.Tensor,
                attn: LayerAttention = PLAIN_ATTENTION) -> None:
        if not isinstance(batch, KernelBatch):
            return super()._decode(layer, q, k, v, kv_cache, batch, out)
        assert isinstance(kv_cache, torch.Tensor)
        rows = q[batch.start:batch.end].contiguous()  # a copy only for a strided q
        self.decode_kernel.decode_attention(rows, out, kv_cache[:, layer, 0], kv_cache[:, layer, 1],
                                      batch.block_tables, batch.seq_lens, batch.query_len,
                                      self.scale, self.threads)
        return None

    def _plan_prefills(self, step: StepMetadata, starts: list[int]) -> list[Any]:
        if not self.prefill_kernel or step.num_decodes == step.num_seqs:
            return super()._plan_prefills(step, starts)
        seqs = range(step.num_decodes, step.num_seqs)
        spans = torch.tensor([[starts[s] for s in seqs],
                              [step.query_lens_host[s] for s in seqs],
                              [step.seq_lens_host[s] for s in seqs]], dtype=torch.int64)
        return [KernelPrefill(spans, step.block_tables[step.num_decodes:])]

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: KVCache, prefills: list[Any], out: torch.Tensor,
                 attn: LayerAttention = PLAIN_ATTENTION) -> None:
        if not (prefills and isinstance(prefills[0], KernelPrefill)):
            return super()._prefill(layer, q, k, v, kv_cache, prefills, out)
        assert isinstance(kv_cache, torch.Tensor) and self.kernels is not None
        self.kernels.prefill_attention(q.contiguous(), out, kv_cache[:, layer, 0],
                                       kv_cache[:, layer, 1], prefills[0].block_tables,
                                       prefills[0].spans, self.scale, self.threads)
