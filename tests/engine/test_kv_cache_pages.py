"""A CPU KV cache is asked for transparent huge pages before it is first touched (decode steps
read blocks scattered over it: fewer TLB misses). Linux takes the advice unless transparent
huge pages are off, which is what the skip says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.engine.kv_cache import HUGE_PAGE, KVCacheSpec, allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off (or not Linux) here")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the cache")


def test_a_cpu_cache_is_zeroed_in_huge_pages() -> None:
    spec = KVCacheSpec(num_blocks=1024, block_size=16, num_layers=4, num_kv_heads=2,
                       head_dim=64, dtype="bfloat16")
    cache = allocate_kv_cache(spec)
    assert cache.numel() * cache.element_size() >= 8 * HUGE_PAGE
    assert int(cache.count_nonzero()) == 0
    assert anon_huge_kb(cache.data_ptr() + cache.numel() * cache.element_size() // 2) > 0
    if "[madvise]" in THP.read_text():  # only what is advised gets them: the control
        plain = torch.zeros(spec.shape, dtype=torch.bfloat16)
        assert anon_huge_kb(plain.data_ptr() + plain.numel()) == 0
