"""Paged attention over the block-major KV cache, behind one small interface.

The model runner builds one ``StepMetadata`` per step (``metadata.py``); the backend turns it
into its own plan once (``prepare``) and every layer calls ``forward`` with that plan, which
also writes the step's new K/V into the cache. Backends:

- ``torch`` (``torch_backend.py``): gather + ``scaled_dot_product_attention``; the reference,
  and the CPU path for float32 (exact against transformers).
- ``cpu`` (``cpu_backend.py``): decoding sequences through our C kernel reading the cache in
  place: bfloat16 on x86 with AVX-512 BF16, float32 on x86 with AVX2 and FMA (built at install,
  else with the machine's C compiler on first use: ``cpu_kernels.py``); prefill as ``torch``
  (bfloat16 on AMX: our kernel).
- ``triton`` (``triton_backend.py``): our paged kernels reading K/V in place; the default on
  CUDA. On a CPU it runs only under ``TRITON_INTERPRET=1`` (tests).
- ``flash_attn`` (``flash_backend.py``): flash-attn's paged varlen kernel, when the package is
  installed (CUDA only; blocks of a multiple of 256 tokens).

``auto`` picks triton on a CUDA device when Triton imports; on a CPU, cpu for a bfloat16 or
float32 cache when its kernel can run here, else torch.

Each layer tells ``forward`` what its attention computes (``LayerAttention``: Gemma's sliding
windows, logit soft-capping and query scale). Only torch implements more than plain causal
attention: for a model whose layers ask more, ``auto`` picks torch and any other backend named
is refused at start-up, naming what the model needs.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Collection
from typing import Any, Protocol

import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention.metadata import StepMetadata, build_step_metadata
from tandem.services.engine.config import (
    ATTENTION_BACKENDS,
    PLAIN_ATTENTION,
    LayerAttention,
)
from tandem.services.engine.kv_cache import KVCache

__all__ = ["BACKENDS", "PLAIN_ATTENTION", "AttentionBackend", "LayerAttention", "StepMetadata",
           "build_step_metadata", "check_features", "get_attention_backend",
           "resolve_backend"]

BACKENDS = ATTENTION_BACKENDS


class AttentionBackend(Protocol):
    name: str

    def prepare(self, step: StepMetadata) -> Any:
        """The backend's plan for one step; every layer's ``forward`` gets it."""
        ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, plan: Any, attn: LayerAttention = PLAIN_ATTENTION
                ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] for the step's tokens into the cache (an int8 cache quantizes
        them); return the attention output of q [T, Hq, D] as [T, Hq * D], computed as the
        layer's ``attn`` says. Only torch implements more than plain attention: the model
        refuses the others for layers that ask more (``check_features``) when it is built."""
        ...


def resolve_backend(name: str, device: str, kv_dtype: torch.dtype | None = None,
                    features: Collection[str] = ()) -> str:
    """``name`` with ``auto`` resolved for a cache of ``kv_dtype`` elements (int8: quantized;
    None: not known yet) and a model whose layers' attention asks ``features`` beyond plain
    attention (``ModelConfig.attention_features``); raises ValueError for one that cannot run
    here or cannot compute that model's attention."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    check_features(name, features)
    if features:
        return "torch"
    on_cuda = torch.device(device).type == "cuda"
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if on_cuda:
            return "triton" if has_triton else "torch"
        if kv_dtype in CPU_KERNEL_DTYPES and _cpu_kernel_missing(kv_dtype) is None:
            return "cpu"
        return "torch"
    if name == "cpu":
        if on_cuda:
            raise ValueError(f"attention_backend cpu runs on a CPU (device is {device!r})")
        if kv_dtype is not None and kv_dtype not in CPU_KERNEL_DTYPES:
            raise ValueError(f"attention_backend cpu needs a bfloat16 or float32 KV cache "
                             f"(kv_cache_dtype auto), not {str(kv_dtype).removeprefix('torch.')}")
        reason = _cpu_kernel_missing(kv_dtype)
        if reason is not None:
            raise ValueError(f"attention_backend cpu cannot run here: {reason}")
    if name == "triton":
        if not has_triton:
            raise ValueError("attention_backend triton needs the triton package "
                             "(pip install triton)")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend triton needs a CUDA device (device is "
                             f"{device!r}); on a CPU use torch (or TRITON_INTERPRET=1 to test)")
    if name == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError("attention_backend flash_attn needs the flash_attn package "
                             "(pip install 'tandem[gpu]': flash-attn builds against CUDA)")
        if not on_cuda:
            raise ValueError(f"attention_backend flash_attn needs a CUDA device (device is "
                             f"{device!r})")
    return name


CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _cpu_kernel_missing(kv_dtype: torch.dtype | None) -> str | None:
    """Why the cpu backend's kernel for a ``kv_dtype`` cache cannot run here (None: it can;
    a cache of unknown dtype: either kernel)."""
    if kv_dtype == torch.float32:
        return cpu_kernels.f32_unavailable_reason()
    bf16 = cpu_kernels.unavailable_reason()
    if kv_dtype is None and bf16 is not None:
        return cpu_kernels.f32_unavailable_reason() and bf16
    return bf16


def check_features(name: str, features: Collection[str]) -> None:
    """Refuse backend ``name`` for a model whose layers' attention asks ``features`` beyond
    plain attention: torch alone implements them (and ``auto`` picks it)."""
    if features and name not in ("auto", "torch"):
        raise ValueError(f"attention_backend {name} does not implement "
                         f"{', '.join(sorted(features))}, which this model's layers use; use "
                         f"attention_backend torch (or auto, which picks it)")


def get_attention_backend(name: str, device: str, num_heads: int, num_kv_heads: int,
                          head_dim: int, kv_dtype: torch.dtype | None = None,
                          kernel_threads: int = 1, features: Collection[str] = ()
                          ) -> AttentionBackend:
    """``kernel_threads``: what the cpu backend's decode kernel may split over (1 or 2);
    ``features``: what the model's layers ask beyond plain attention (``resolve_backend``)."""
    name = resolve_backend(name, device, kv_dtype, features)
    if name == "cpu":
        from tandem.services.engine.attention.cpu_backend import CpuAttention
        return CpuAttention(num_heads // num_kv_heads, num_kv_heads, head_dim, kernel_threads,
                            torch.float32 if kv_dtype == torch.float32 else torch.bfloat16)
    if name == "triton":
        from tandem.services.engine.attention.triton_backend import TritonAttention
        return TritonAttention(num_kv_heads, head_dim, device)
    if name == "flash_attn":
        from tandem.services.engine.attention.flash_backend import FlashAttention
        return FlashAttention(head_dim)
    from tandem.services.engine.attention.torch_backend import TorchAttention
    return TorchAttention(num_heads // num_kv_heads)
