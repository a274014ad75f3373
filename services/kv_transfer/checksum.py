"""Per-block CRC32 of KV bytes (debug mode): the prefill worker sends them, decode verifies."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The block-major KV cache as ``[num_blocks, bytes_per_block]`` uint8 (a view, no copy)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be one contiguous tensor")
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


def block_checksums(blocks: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """CRC32 of each block in ``block_ids``; ``blocks`` as returned by ``block_bytes``."""
    return [zlib.crc32(blocks[b].cpu().numpy().data) for b in block_ids]
