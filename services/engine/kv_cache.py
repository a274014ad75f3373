"""The worker's one preallocated paged KV cache.

Layout ``[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]``: block-major, so
one block of every layer is a single contiguous byte range. KV transfer moves a block with one
descriptor, and the whole tensor is registered with the transport once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.torch_dtype).element_size()
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * element)

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, dtype: str,
                  num_blocks: int | None, memory_gb: float) -> KVCacheSpec:
        spec = cls(1, block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
        if num_blocks is None:
            num_blocks = int(memory_gb * 2**30) // spec.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {memory_gb} GiB holds no {spec.bytes_per_block}-byte block"
            )
        return cls(num_blocks, block_size, model.num_layers, model.num_kv_heads,
                   model.head_dim, dtype)


def allocate_kv_cache(spec: KVCacheSpec, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(spec.shape, dtype=spec.torch_dtype, device=device)
