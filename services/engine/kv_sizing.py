"""How many KV blocks an engine gets, and the context length they must hold.

The blocks, in order of what is set:

- ``num_kv_blocks``: that many;
- ``kv_cache_memory_gb``: as many as fit in that much memory;
- neither, on a CPU: ``CPU_KV_CACHE_GB``;
- neither, on a GPU: vLLM's rule. ``gpu_memory_utilization`` of the device's memory is this
  engine's; what a profiling forward at the largest step leaves of it (the weights, the step's
  activations and logits, the CUDA context and whatever else the device holds) is KV blocks.

The context (``max_model_len``) is the one asked for, else the model's; longer than the
model's is refused. A cache that cannot hold one sequence of it is refused at start-up, with the
numbers, unless the cache was sized by hand (``num_kv_blocks`` or ``kv_cache_memory_gb``) and no
length was asked for: then the context is what the cache holds, and the engine logs that it is
shorter than the model's. The capacity goes into the engine's log line, its stats and the ready
line of ``tandem up``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CPU_KV_CACHE_GB = 1.0
GIB = 2**30


class KVCacheTooSmall(ValueError):
    """The KV cache cannot hold one sequence of the context length."""


def blocks_in(memory_gb: float, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` in ``memory_gb`` GiB (ValueError when not even one)."""
    blocks = int(memory_gb * GIB) // bytes_per_block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {memory_gb} GiB holds no {bytes_per_block}-byte "
                         f"block")
    return blocks


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as a profiling forward left it (bytes)."""

    total: int  # the device's memory
    free: int  # free on the device now (every process counted)
    torch_reserved: int  # what this process's torch allocator holds now
    torch_peak: int  # the most this process's tensors held during the profiling forward
    profile_cache: int  # the profiling forward's own small KV cache (freed before sizing)

    @classmethod
    def measure(cls, device: str | torch.device, profile_cache: int) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_reserved(device),
                   torch.cuda.max_memory_allocated(device), profile_cache)


def gpu_kv_bytes(memory: DeviceMemory, utilization: float) -> int:
    """The KV cache's bytes: ``utilization`` of the device, less the profiling forward's peak
    (weights and activations, without its own cache) and everything outside this process's
    allocator (the CUDA context, NCCL buffers, other processes)."""
    outside_torch = memory.total - memory.free - memory.torch_reserved
    return int(memory.total * utilization) - (memory.torch_peak - memory.profile_cache) \
        - outside_torch


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, kv_cache: object, block_size: int, tokens: int,
                    logits_rows: int, device: str | torch.device) -> None:
    """One step at the scheduler's largest: ``tokens`` of one prompt through every layer, and
    ``logits_rows`` rows of logits softmaxed (a full decode batch's sampling)."""
    from tandem.services.engine.attention import build_step_metadata

    blocks = list(range(-(-tokens // block_size)))
    step = build_step_metadata([tokens], [tokens], [blocks], 0, block_size, device)
    plan = model.attention.prepare(step)  # type: ignore[attr-defined]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device)
    rows = torch.arange(tokens - min(logits_rows, tokens), tokens, device=device)
    model(ids, positions, kv_cache, plan, rows).softmax(-1)
    torch.cuda.synchronize(device)


def context_length(asked: int | None, model_len: int, capacity_tokens: int, hand_sized: bool,
                   sizing: str) -> int:
    """The engine's max_model_len: ``asked`` (refused beyond the model's), else the model's;
    refused when the cache holds fewer tokens, unless the cache was ``hand_sized`` and no
    length was asked (then what it holds, logged). ``sizing``: how the cache was sized, for
    the messages."""
    if asked is not None and asked > model_len:
        raise KVCacheTooSmall(f"max_model_len {asked} is longer than the model's context "
                              f"({model_len} tokens)")
    wanted = asked or model_len
    if capacity_tokens >= wanted:
        return wanted
    if asked is None and hand_sized:
        log.warning("max_model_len %d, not the model's %d: the KV cache (%s) holds only %d "
                    "tokens", capacity_tokens, model_len, sizing, capacity_tokens)
        return capacity_tokens
    raise KVCacheTooSmall(
        f"the KV cache ({sizing}) holds {capacity_tokens} tokens, fewer than one sequence of "
        f"max_model_len {wanted}{'' if asked else ' (the model context)'}: give the cache more "
        f"memory (kv_cache_memory_gb, or gpu_memory_utilization on a GPU) or set "
        f"max_model_len to at most {capacity_tokens}")
