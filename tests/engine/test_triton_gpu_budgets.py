"""What our attention kernels would ask of an H100/H200, checked without one.

Every launch configuration the engine can pick is compiled for sm_90 (``tests/engine/sm90.py``):
no variant may spill registers or ask for more shared memory than one block can have. And a
serving trace (batches growing and shrinking, prefill chunks, prefix hits) must not make
Triton compile a new variant per batch size: only the tile choice (a constexpr) may differ.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():  # setdefault: sm90.compile_launches sets it to 0
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.services.engine.attention import triton_kernels, triton_ops  # noqa: E402
from tandem.services.engine.attention.triton_kernels import paged_attention, store_kv  # noqa: E402
from tandem.services.engine.config import EngineConfig  # noqa: E402
from tandem.services.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.services.protocol.request import (
    GenerationRequest,
    SamplingParams,  # noqa: E402
)
from tests.engine.sm90 import H100_SHARED_BYTES, SpecializationRecorder, compile_launches  # noqa: E402


def _step(num_seqs: int, query_len: int, seq_len: int, heads: tuple[int, int, int],
          block_size: int, dtype: torch.dtype, quantized: bool) -> None:
    """One layer's store and attention for ``num_seqs`` sequences of the given shape, on CPU
    tensors (compiled, never run)."""
    num_heads, num_kv_heads, head_dim = heads
    tokens = num_seqs * query_len
    blocks = -(-seq_len // block_size)
    cache_dtype = torch.int8 if quantized else dtype
    cache = torch.empty(num_seqs * blocks, 1, 2, block_size, num_kv_heads, head_dim,
                        dtype=cache_dtype)
    scales = (torch.empty(cache.shape[:-1], dtype=torch.float32) if quantized else None)
    qkv = torch.empty(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    slots = torch.zeros(tokens, dtype=torch.long)
    store_kv(cache, 0, k, v, slots, scales)
    query_start = torch.arange(num_seqs + 1, dtype=torch.int32) * query_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    tables = torch.zeros(num_seqs, blocks, dtype=torch.int32)
    splits = triton_kernels.choose_num_splits(num_seqs, num_kv_heads, query_len, seq_len)
    paged_attention(q, cache, 0, query_start, seq_lens, tables, query_len, seq_len,
                    head_dim ** -0.5, num_splits=splits, scales=scales)


LLAMA3_8B = (32, 8, 128)


# (heads (query, KV, head dim), dtype, block size, int8 cache): the built-in model's GQA 9/3,
# Llama-3-8B's 32/8, head dims 64 to 256, blocks of 16 and of 256 tokens (what flash_attn
# forces), bfloat16, float16, float32 and int8 caches.
CACHES = [((9, 3, 64), torch.bfloat16, 16, False), ((9, 3, 64), torch.bfloat16, 16, True),
          (LLAMA3_8B, torch.bfloat16, 16, False), (LLAMA3_8B, torch.bfloat16, 256, False),
          (LLAMA3_8B, torch.bfloat16, 256, True), (LLAMA3_8B, torch.float16, 16, False),
          (LLAMA3_8B, torch.float32, 16, False), ((16, 8, 256), torch.bfloat16, 256, False),
          ((16, 8, 256), torch.float32, 16, False)]


def every_launch_configuration() -> None:
    """Decode (with split-KV), draft verification and prefill steps over each cache."""
    for heads, dtype, block_size, quantized in CACHES:
        _step(1, 1, 8192, heads, block_size, dtype, quantized)  # split-KV decode
        _step(64, 1, 300, heads, block_size, dtype, quantized)
        _step(4, 4, 300, heads, block_size, dtype, quantized)  # drafts
        _step(1, 512, 512, heads, block_size, dtype, quantized)  # prefill


def test_every_launch_fits_an_sm90_block() -> None:
    usages = compile_launches(f"{__name__}:every_launch_configuration")
    kernels = {u.kernel for u in usages}
    assert {"_paged_attention_kernel", "_store_kv_kernel", "_reduce_splits_kernel"} <= kernels
    over = [u for u in usages if u.shared_bytes > H100_SHARED_BYTES]
    assert not over, f"more shared memory than an sm_90 block has: {over}"
    spills = [u for u in usages if u.local_bytes]
    assert not spills, f"register spills: {spills}"


def test_a_serving_trace_compiles_one_variant_per_tile_choice(loaded_model, prompts) -> None:  # type: ignore[no-untyped-def]
    # Requests of different lengths arriving while others decode: batches of 1 to 6
    # sequences, prefill chunks beside decodes, block tables of changing widths, a prefix hit.
    short = dataclasses.replace(loaded_model, config=dataclasses.replace(loaded_model.config,
                                                                         num_layers=2))
    engine = LLMEngine(EngineConfig(num_kv_blocks=96, attention_backend="triton",
                                    max_num_batched_tokens=24), short)
    recorder = SpecializationRecorder()
    kernels = (triton_kernels._paged_attention_kernel, triton_ops._rms_norm_kernel,
               triton_ops._rotary_store_kernel, triton_ops._silu_mul_kernel)
    with recorder.watching(*kernels):
        for count, (prompt, tokens) in enumerate([(prompts[0], 9), (prompts[1][:7], 5),
                                                  (prompts[2], 3), (prompts[0], 7),
                                                  (prompts[1], 4), (prompts[2][:3], 8)]):
            engine.add_request(GenerationRequest(f"r{count}", prompt, SamplingParams(
                max_tokens=tokens, temperature=0.0, ignore_eos=True)))
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    assert recorder.launches["_paged_attention_kernel"] > 20
    assert all(recorder.launches[k.fn.__name__] > 20 for k in kernels)
    for name, keys in recorder.keys.items():
        assert len(keys) == len(recorder.tile_choices(name)), (name, keys)
    # Decode tiles and prefill tiles: two choices, not one per batch size.
    assert len(recorder.keys["_paged_attention_kernel"]) == 2
