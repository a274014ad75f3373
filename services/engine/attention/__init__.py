"""Paged attention over the block-major KV cache, behind one small interface.

The model runner builds one ``StepMetadata`` per step (``metadata.py``); the backend turns it
into its own plan once (``prepare``) and every layer calls ``forward`` with that plan, which
also writes the step's new K/V into the cache. Backends:

- ``torch`` (``torch_backend.py``): gather + ``scaled_dot_product_attention``; the reference
  and the CPU path.
- ``triton`` (``triton_backend.py``): our paged kernels reading K/V in place; the default on
  CUDA. On a CPU it runs only under ``TRITON_INTERPRET=1`` (tests).
- ``flash_attn`` (``flash_backend.py``): flash-attn's paged varlen kernel, when the package is
  installed (CUDA only; blocks of a multiple of 256 tokens).

``auto`` picks triton on a CUDA device when Triton imports, else torch.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Protocol

import torch

from services.engine.attention.metadata import StepMetadata, build_step_metadata
from services.engine.config import ATTENTION_BACKENDS
from services.engine.kv_cache import KVCache

__all__ = ["BACKENDS", "AttentionBackend", "StepMetadata", "build_step_metadata",
           "get_attention_backend", "resolve_backend"]

BACKENDS = ATTENTION_BACKENDS


class AttentionBackend(Protocol):
    name: str

    def prepare(self, step: StepMetadata) -> Any:
        """The backend's plan for one step; every layer's ``forward`` gets it."""
        ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, plan: Any) -> torch.Tensor:
        """Write k/v [T, Hkv, D] for the step's tokens into the cache (an int8 cache quantizes
        them); return the attention output of q [T, Hq, D] as [T, Hq * D]."""
        ...


def resolve_backend(name: str, device: str) -> str:
    """``name`` with ``auto`` resolved; raises ValueError for one that cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    on_cuda = torch.device(device).type == "cuda"
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if on_cuda and has_triton else "torch"
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
                             "(pip install flash-attn, a CUDA build)")
        if not on_cuda:
            raise ValueError(f"attention_backend flash_attn needs a CUDA device (device is "
                             f"{device!r})")
    return name


def get_attention_backend(name: str, device: str, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> AttentionBackend:
    name = resolve_backend(name, device)
    if name == "triton":
        from services.engine.attention.triton_backend import TritonAttention
        return TritonAttention(num_kv_heads, head_dim, device)
    if name == "flash_attn":
        from services.engine.attention.flash_backend import FlashAttention
        return FlashAttention(head_dim)
    from services.engine.attention.torch_backend import TorchAttention
    return TorchAttention(num_heads // num_kv_heads)
