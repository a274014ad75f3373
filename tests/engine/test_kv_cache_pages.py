"""A CPU KV cache is zeroed in small pages, then advised for transparent huge pages and collapsed
into them by a background thread (decode steps read blocks scattered over it: fewer TLB
misses). Checked in a fresh process, where nothing earlier was advised: the cache's mapping
carries the advice (``hg`` in /proc/self/smaps's VmFlags), a plain allocation's does not, and
once the thread is done (on Linux 6.1+, which has MADV_COLLAPSE) huge pages back the cache.
Skipped where transparent huge pages are off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off (or not Linux) here")

PROBE = """
import json
import platform
import threading
from pathlib import Path

import torch

from tandem.services.engine.kv_cache import (
    COLLAPSE_THREAD,
    HUGE_PAGE,
    KVCacheSpec,
    allocate_kv_cache,
)


def mapping(address):
    # the smaps fields of the mapping holding the address
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside:
            fields[head.rstrip(":")] = line.split()[1:]
            if head == "VmFlags:":
                return fields
    raise AssertionError("no mapping holds the address")


spec = KVCacheSpec(num_blocks=1024, block_size=16, num_layers=4, num_kv_heads=2, head_dim=64,
                   dtype="bfloat16")
plain = torch.zeros(spec.shape, dtype=torch.bfloat16)  # first: nothing advised to reuse
cache = allocate_kv_cache(spec)
size = cache.numel() * cache.element_size()
advised = mapping(cache.data_ptr() + size // 2)["VmFlags"]
for thread in threading.enumerate():
    if thread.name == COLLAPSE_THREAD:
        thread.join(60)
kernel = tuple(int(part) for part in platform.release().split(".")[:2])
print(json.dumps({"bytes": size, "huge_page": HUGE_PAGE, "zeros": int(cache.count_nonzero()),
                  "cache": advised, "plain": mapping(plain.data_ptr() + size // 2)["VmFlags"],
                  "huge_kib": int(mapping(cache.data_ptr() + size // 2)["AnonHugePages"][0]),
                  "collapse": kernel >= (6, 1)}))
"""


def test_a_cpu_cache_is_zeroed_then_moved_into_huge_pages() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120, check=True, cwd=Path(__file__).parents[2])
    probe = json.loads(done.stdout.splitlines()[-1])
    assert probe["bytes"] >= 8 * probe["huge_page"] and probe["zeros"] == 0
    assert "hg" in probe["cache"]
    assert "hg" not in probe["plain"]
    if probe["collapse"]:  # else khugepaged collapses it in its own time
        assert probe["huge_kib"] * 1024 >= 4 * probe["huge_page"]
