"""Per-block CRC32 of KV bytes (debug mode): the prefill worker sends them, decode verifies."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def block_checksums(blocks: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """CRC32 of each block in ``block_ids``; ``blocks`` as returned by ``kv_cache.block_bytes``."""
    return [zlib.crc32(blocks[b].cpu().numpy().data) for b in block_ids]
