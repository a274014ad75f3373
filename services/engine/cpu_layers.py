"""A step's decoder layers in one call of our C kernels (``csrc/layers.c``) on the cpu backend.

``LlamaModel.hidden`` on the cpu attention backend calls ~10 kernels a layer from Python; the
interpreter's work around those calls (views, checks, outputs allocated, ctypes arguments) was
~110 us a layer, ~3.4 ms of a ~19 ms decode step of the built-in model. ``CpuLayers`` checks a
step once, allocates its buffers once and runs every layer in C: the same kernels, in the same
order, on the same inputs, so the same bits (tests/engine/test_cpu_layers.py). A model it does
not fit (``CpuLayers.of`` returns None: projections not all on AMX, q/k norms, tensor
parallelism) or a step it does not take (``run`` returns None: a decode run the kernel leaves
to SDPA, prefill chunks without the AMX kernel) runs layer by layer as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.services.engine.attention.cpu_backend import CpuAttention, KernelBatch, KernelPrefill
from tandem.services.engine.attention.torch_backend import TorchPlan
from tandem.services.engine.cpu_kernels import AmxLinear, DecodeRun, Kernels, LayerWeights, Step
from tandem.services.engine.kv_cache import KVCache
from tandem.services.engine.layer import Layer


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _projections(layer: Layer) -> tuple[AmxLinear, AmxLinear, AmxLinear, AmxLinear] | None:
    """qkv, o, gate_up, down, when all four run on our AMX kernel."""
    qkv, o, gate_up, down = layer.qkv, layer.o, layer.gate_up, layer.down
    if (isinstance(qkv, AmxLinear) and isinstance(o, AmxLinear)
            and isinstance(gate_up, AmxLinear) and isinstance(down, AmxLinear)):
        return qkv, o, gate_up, down
    return None


def _layer_weights(layer: Layer) -> LayerWeights:
    projections = _projections(layer)
    assert projections is not None  # CpuLayers.of checked
    return LayerWeights(_ptr(layer.input_norm), _ptr(layer.post_norm),
                        *(p for proj in projections for p in (_ptr(proj.weight),
                                                              _ptr(proj.bias))))


class CpuLayers:
    def __init__(self, kernels: Kernels, layers: Sequence[Layer], attention: CpuAttention,
                 heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, threads: int) -> None:
        self.kernels = kernels
        self.layers = list(layers)  # holds the tensors the pointers below point into
        self.attention = attention
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate, self.eps = intermediate, eps
        self.cos, self.sin, self.threads = cos, sin, threads
        self.weights = (LayerWeights * len(self.layers))(*map(_layer_weights, self.layers))
        self.linear_threads = self.layers[0].qkv.threads  # type: ignore[union-attr]  # of: all AMX

    @classmethod
    def of(cls, kernels: Kernels | None, layers: Sequence[Layer], attention: object,
           heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
           cos: torch.Tensor, sin: torch.Tensor, threads: int, sharded: bool
           ) -> CpuLayers | None:
        """The driver for these layers, or None where they do not fit it: every projection
        on AMX (gate/up with SwiGLU), no q/k norms, one rank, the cpu backend with its
        prefill kernel, bfloat16 contiguous norms and rotary tables."""
        if (kernels is None or not kernels.amx or not layers or sharded
                or not isinstance(attention, CpuAttention) or not attention.prefill_kernel):
            return None
        for layer in layers:
            projections = _projections(layer)
            if projections is None:
                return None
            qkv, o, gate_up, down = projections
            if (not gate_up.swiglu or qkv.swiglu or o.swiglu or down.swiglu
                    or len({p.threads for p in projections}) != 1
                    or layer.q_norm is not None or layer.k_norm is not None):
                return None
            tensors = [layer.input_norm, layer.post_norm,
                       *(p.bias for p in projections if p.bias is not None)]
            if not all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors):
                return None
        if not all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.dim() == 2
                   and t.shape[1] == head_dim for t in (cos, sin)):
            return None
        return cls(kernels, layers, attention, heads, kv_heads, head_dim, intermediate, eps,
                   cos, sin, threads)

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
            plan: TorchPlan, num_layers: int) -> torch.Tensor | None:
        """Layers ``0 .. num_layers - 1`` over the step: ``x`` [tokens, hidden] (the
        embeddings; the residual stream, updated in place and returned), ``positions``
        [tokens] int64. None, having done nothing, when the step has a part the kernels do
        not take."""
        decodes = plan.decodes
        if (not all(isinstance(d, KernelBatch) for d in decodes)
                or not all(isinstance(p, KernelPrefill) for p in plan.prefills)
                or len(plan.prefills) > 1 or not isinstance(kv_cache, torch.Tensor)):
            return None
        tokens, hidden = x.shape
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        blocks, offsets = plan.slot_blocks, plan.slot_offsets
        if not (x.is_contiguous() and x.dtype == torch.bfloat16 and positions.is_contiguous()
                and positions.dtype == torch.int64 and positions.numel() == tokens
                and blocks.dtype == offsets.dtype == torch.int64 and blocks.is_contiguous()
                and offsets.is_contiguous() and blocks.numel() == offsets.numel() == tokens
                and kv_cache.dtype == torch.bfloat16 and kv_cache.dim() == 6
                and kv_cache.shape[1] >= num_layers
                and kv_cache.shape[4:] == (kv_heads, d) and kv_cache.stride()[4:] == (d, 1)
                and num_layers <= len(self.layers)):
            raise ValueError("cpu layers: a step's tensors do not fit the model")
        runs = (DecodeRun * max(len(decodes), 1))()
        for i, batch in enumerate(decodes):
            tables, lens = batch.block_tables, batch.seq_lens
            if not (tables.dtype == lens.dtype == torch.int32 and tables.stride(1) == 1
                    and lens.is_contiguous() and batch.end <= tokens
                    and batch.end - batch.start == lens.numel() * batch.query_len):
                raise ValueError("cpu layers: a decode run's tables do not fit")
            runs[i] = DecodeRun(batch.start, lens.numel(), batch.query_len, tables.stride(0),
                                tables.data_ptr(), lens.data_ptr())
        spans = tables = None
        if plan.prefills:
            prefill = plan.prefills[0]
            spans, tables = prefill.spans, prefill.block_tables
            if not (spans.dtype == torch.int64 and spans.is_contiguous() and spans.dim() == 2
                    and spans.shape[0] == 3 and tables.dtype == torch.int32
                    and tables.stride(1) == 1):
                raise ValueError("cpu layers: the prefill spans do not fit")
        bf16 = torch.bfloat16
        h = torch.empty((tokens, hidden), dtype=bf16)
        qkv = torch.empty((tokens, (heads + 2 * kv_heads) * d), dtype=bf16)
        q = torch.empty((tokens, heads, d), dtype=bf16)
        k = torch.empty((tokens, kv_heads, d), dtype=bf16)
        attn = torch.empty((tokens, heads * d), dtype=bf16)
        act = torch.empty((tokens, self.intermediate), dtype=bf16)
        step = Step(
            hidden, heads, kv_heads, d, self.intermediate, self.eps, self.attention.scale,
            kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.shape[3], kv_cache.stride(0),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            self.cos.data_ptr(), self.sin.data_ptr(), self.cos.shape[0],
            tokens, positions.data_ptr(), blocks.data_ptr(), offsets.data_ptr(),
            runs, len(decodes),
            _ptr(spans), 0 if spans is None else spans.shape[1],
            0 if tables is None else tables.stride(0), _ptr(tables),
            x.data_ptr(), h.data_ptr(), qkv.data_ptr(), q.data_ptr(), k.data_ptr(),
            attn.data_ptr(), act.data_ptr(),
            self.threads, self.linear_threads, self.attention.threads)
        self.kernels.layers(self.weights, num_layers, step)
        return x
