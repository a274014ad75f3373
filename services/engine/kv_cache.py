"""The worker's one preallocated paged KV cache.

Layout ``[num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]``: block-major, so
one block of every layer is a single contiguous byte range. KV transfer moves a block with one
descriptor, and the whole tensor is registered with the transport once.

``kv_dtype`` ``int8`` (``QuantizedKV``) keeps the values as int8 with a float32 scale per
(block slot, KV head) for keys and values alike (symmetric absmax: ``x ~ q * scale``,
``scale = max|x| / 127``). A block's scales follow its values inside the block's byte range
(``[num_blocks, bytes_per_block]`` uint8 underneath), so transports and checksums, which move
and hash a block's bytes, carry the scales with the values unchanged. A token's row is
quantized once, when it is stored, from its own values alone: a block's contents depend on its
tokens only (never on how many writes filled it), so a cached prefix reads the same values on
every hit, and no stored row is ever re-scaled.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from tandem.services.engine.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCALE_BYTES = 4  # float32
INT8_MAX = 127


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the model's compute dtype
    kv_dtype: str = "auto"  # auto: the cache holds `dtype`; int8: int8 values + float32 scales

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the cache's values."""
        return torch.int8 if self.quantized else _DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return self.shape[:-1]

    @property
    def value_bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.torch_dtype).element_size()
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * element)

    @property
    def bytes_per_block(self) -> int:
        """A block's bytes, scales included: what a transfer moves and the budget divides."""
        scales = (self.num_layers * 2 * self.block_size * self.num_kv_heads * _SCALE_BYTES
                  if self.quantized else 0)
        return self.value_bytes_per_block + scales

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, dtype: str,
                  num_blocks: int | None, memory_gb: float,
                  kv_dtype: str = "auto") -> KVCacheSpec:
        spec = cls(1, block_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype,
                   kv_dtype)
        if num_blocks is None:
            num_blocks = int(memory_gb * 2**30) // spec.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {memory_gb} GiB holds no {spec.bytes_per_block}-byte block"
            )
        return cls(num_blocks, block_size, model.num_layers, model.num_kv_heads,
                   model.head_dim, dtype, kv_dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` as int8 rows and their float32 scales ``[...]``: symmetric absmax per row,
    rounded half away from zero (the Triton store kernel rounds the same way). A row's error is
    at most ``scale / 2 = max|row| / 254`` per element; an all-zero row has scale 0."""
    x = x.float()
    # Divisions by tensors: torch on a GPU turns a division by a Python number into a product
    # with its reciprocal, which rounds differently from the IEEE division the CPU and our
    # Triton store do (tl.div_rn); this way every device rounds the same.
    amax = x.abs().amax(-1)
    scales = amax / amax.new_full((), INT8_MAX)
    scaled = x / torch.where(scales > 0, scales, 1.0)[..., None]
    values = torch.trunc(scaled + torch.copysign(torch.full_like(scaled, 0.5), scaled))
    return values.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_int8``, in ``dtype``: one int8 x ``dtype`` multiply (type
    promotion, no converted copy; ~10x faster on a CPU than through float32). The scale is
    rounded to ``dtype`` first: in bfloat16 by at most 2**-9 of itself, far below a quantization
    step (1/254 of the row's max)."""
    return values * scales.to(dtype)[..., None]


@dataclass(frozen=True)
class QuantizedKV:
    """An int8 cache: ``values`` and ``scales`` are views into the one byte tensor ``data``."""

    data: torch.Tensor  # [num_blocks, bytes_per_block] uint8: what transfers move
    values: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] int8
    scales: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads] float32

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize k, v [T, Hkv, D] into their slots (``blocks``, ``offsets``: [T]); return
        them as attention reads them back (dequantized, in k's dtype)."""
        stored = []
        for kv, x in enumerate((k, v)):
            values, scales = quantize_int8(x)
            self.values[:, layer, kv][blocks, offsets] = values
            self.scales[:, layer, kv][blocks, offsets] = scales
            stored.append(dequantize_int8(values, scales, x.dtype))
        return stored[0], stored[1]

    def gather(self, layer: int, kv: int, blocks: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        """Blocks ``blocks`` of the layer's keys (kv 0) or values (1), dequantized:
        ``[len(blocks), block_size, Hkv, D]`` in ``dtype``."""
        return dequantize_int8(self.values[:, layer, kv].index_select(0, blocks),
                               self.scales[:, layer, kv].index_select(0, blocks), dtype)


KVCache = torch.Tensor | QuantizedKV  # kv_dtype auto: the values tensor itself


def allocate_kv_cache(spec: KVCacheSpec, device: str = "cpu") -> KVCache:
    if not spec.quantized:
        return _zeros(spec.shape, spec.torch_dtype, device)
    data = _zeros((spec.num_blocks, spec.bytes_per_block), torch.uint8, device)
    split = spec.value_bytes_per_block
    return QuantizedKV(data, data[:, :split].view(torch.int8).view(spec.shape),
                       data[:, split:].view(torch.float32).view(spec.scales_shape))


HUGE_PAGE = 1 << 21
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # MADV_COLLAPSE: Linux 6.1+
COLLAPSE_CHUNK = 4 << 20  # bytes collapsed per call (the thread checks between calls)
COLLAPSE_REST = 3.0  # the thread rests this many times as long as each call took
COLLAPSE_THREAD = "kv-huge-pages"
SYS_MADVISE = {"x86_64": 28, "aarch64": 233}  # the raw system call's number


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed cache tensor; on a CPU, moved into transparent huge pages after it is zeroed
    (``collapse_to_huge_pages``). A decode step reads every sequence's blocks, scattered over
    the cache: with 4 KiB pages most blocks cost TLB misses (the cpu backend's attention in a
    batch-32 decode step: 28.4 -> 23.2 ms, docs/loadtest.md). Zeroed first in small pages: a
    1-GiB cache faulted in huge pages took 7.5-10 s on a fresh process here (a VM whose free
    memory is handed back to its host), in small pages 0.6 s."""
    out = torch.zeros(shape, dtype=dtype, device=device)
    if out.device.type == "cpu":
        collapse_to_huge_pages(out)
    return out


def collapse_to_huge_pages(t: torch.Tensor) -> bool:
    """Advises ``t``'s whole 2 MiB pages for transparent huge pages, and starts a daemon thread
    that has Linux collapse their small pages into huge ones (``MADV_COLLAPSE``), a chunk at a
    time while ``t`` lives; where the kernel lacks it, khugepaged does it over time. Whether
    Linux took the advice (False off Linux, or with transparent huge pages off)."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if not sys.platform.startswith("linux") or end <= start:
        return False
    if not _madvise(start, end - start, MADV_HUGEPAGE):
        return False
    alive = weakref.ref(t)

    def collapse() -> None:
        for chunk in range(start, end, COLLAPSE_CHUNK):
            held = alive()  # held while Linux moves its pages (a freed range is left alone)
            began = time.monotonic()
            if held is None or not _madvise(chunk, min(COLLAPSE_CHUNK, end - chunk),
                                            MADV_COLLAPSE) and ctypes.get_errno() == errno.EINVAL:
                return  # freed, or a kernel without MADV_COLLAPSE
            del held
            # a quarter of a CPU at most: the engine's first steps come first
            time.sleep(COLLAPSE_REST * (time.monotonic() - began))

    if platform.machine() in SYS_MADVISE:
        threading.Thread(target=collapse, name=COLLAPSE_THREAD, daemon=True).start()
    return True


def _madvise(start: int, length: int, advice: int) -> bool:
    """``madvise`` as the raw system call, not libc's wrapper: NIXL's UCX rewrites that
    wrapper's first instructions when its agent starts (to watch memory being unmapped), and a
    thread waiting inside it through a seconds-long collapse then returns into rewritten code
    (a decode replica's segfault in CI). libc's ``syscall`` is left alone."""
    number = SYS_MADVISE.get(platform.machine())
    libc = ctypes.CDLL(None, use_errno=True)
    if number is None:  # an architecture not listed: the wrapper, only for the advice
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return bool(libc.madvise(start, length, advice) == 0)
    libc.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long
    return bool(libc.syscall(number, start, length, advice) == 0)


def kv_parts(cache: KVCache) -> tuple[torch.Tensor, ...]:
    """The cache's tensors with the KV-head axis at dim 4: its values, and an int8 cache's
    scales (tensor parallelism moves a rank's heads as these slices)."""
    return (cache.values, cache.scales) if isinstance(cache, QuantizedKV) else (cache,)


def kv_storage(cache: KVCache) -> torch.Tensor:
    """The one tensor holding every block's bytes (scales included), for the transports."""
    return cache.data if isinstance(cache, QuantizedKV) else cache


def block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The block-major KV cache as ``[num_blocks, bytes_per_block]`` uint8 (a view, no copy)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be one contiguous tensor")
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
