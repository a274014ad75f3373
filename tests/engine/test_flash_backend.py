"""The flash_attn backend: our adapter against flash-attn's documented semantics.

flash-attn has no CPU build (and cannot be built here), so the adapter is checked against
``documented_varlen``: ``flash_attn_varlen_func`` with a paged cache as its docstring
specifies it (flash-attn 2.6+: q ``(total_q, nheads, headdim)``, k/v caches ``(num_blocks,
page_block_size, nheads_k, headdim)`` with the page size a multiple of 256, int32
``cu_seqlens``/``block_table``, fp16/bf16 only, query head ``h`` reading KV head
``h // (nheads / nheads_k)``, the causal mask aligned to the bottom right). What that checks
is the part we own: the arguments we build from a step, the KV write, the output layout.
Where the package and a GPU are present, the real kernel runs against the same reference.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tandem.services.engine.attention import resolve_backend
from tandem.services.engine.attention.flash_backend import FlashAttention
from tandem.services.engine.attention.metadata import build_step_metadata
from tandem.services.engine.config import FLASH_ATTN_BLOCK_MULTIPLE, EngineConfig
from tandem.services.serving.config import AppConfig, ConfigError
from tests.engine.paged_layouts import (
    BUILTIN,
    DEVICE,
    LAYER,
    LLAMA3,
    MHA,
    assert_matches,
    make_step,
    reference,
)

PAGE = FLASH_ATTN_BLOCK_MULTIPLE
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def documented_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None,
                      causal: bool = False, block_table: torch.Tensor | None = None,
                      **rest: Any) -> torch.Tensor:
    """flash_attn_varlen_func's documented contract, checks included, in float64."""
    assert not rest, f"arguments the adapter should not need: {sorted(rest)}"
    assert block_table is not None and block_table.dtype == torch.int32
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
    assert q.dim() == 3 and k.dim() == v.dim() == 4
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    num_blocks, page, num_kv_heads, head_dim = k.shape
    assert page % 256 == 0 and q.shape[1] % num_kv_heads == 0 and q.shape[2] == head_dim
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    batch = block_table.shape[0]
    assert cu_seqlens_q.numel() == cu_seqlens_k.numel() == batch + 1
    assert int(cu_seqlens_q[-1]) == q.shape[0]
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert q1 - q0 <= max_seqlen_q and seqlen_k <= max_seqlen_k
        pos = torch.arange(seqlen_k)
        pages = block_table[b].cpu().long()[pos // page]
        keys = k.cpu().double()[pages, pos % page].repeat_interleave(group, dim=1)
        values = v.cpu().double()[pages, pos % page].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].cpu().double(), keys) * scale
        if causal:  # bottom right: query i sees keys up to i + seqlen_k - seqlen_q
            limit = torch.arange(q1 - q0) + seqlen_k - (q1 - q0)
            scores = scores.masked_fill(pos[None, None, :] > limit[None, :, None],
                                        float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out.to(q.dtype).to(q.device)


# (query_len, seq_len) per sequence, head layout, shared prefix blocks; pages of 256 tokens.
SCENARIOS = {
    "decode": ([(1, 1), (1, 300), (1, 700), (1, 256)], BUILTIN, 0),
    "speculative": ([(4, 4), (4, 520)], LLAMA3, 0),
    "prefill_chunk": ([(40, 40 + 400), (33, 33)], MHA, 0),
    "mixed_shared_prefix": ([(1, 600), (3, 530), (50, 50 + 470)], BUILTIN, 1),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_adapter_matches_reference(scenario: str) -> None:
    seqs, heads, shared = SCENARIOS[scenario]
    step = make_step(seqs, heads, PAGE, torch.bfloat16, shared_prefix_blocks=shared)
    backend = FlashAttention(heads[2], varlen_func=documented_varlen)
    plan = backend.prepare(step.metadata())
    num_kv_heads = heads[1]
    no_new = step.q.new_empty(0, num_kv_heads, heads[2])
    out = backend.forward(LAYER, step.q, no_new, no_new, step.kv_cache, plan)
    assert out.shape == (step.q.shape[0], heads[0] * heads[2])
    assert_matches(out.view(step.q.shape), reference(step), torch.bfloat16)


def test_the_steps_new_kv_is_written_before_attending() -> None:
    seqs = [(1, 290), (5, 5)]
    step = make_step(seqs, LLAMA3, PAGE, torch.bfloat16, seed=5)
    tables = [step.block_tables[s].tolist() for s in range(len(seqs))]
    metadata = build_step_metadata([q for q, _ in seqs], [n for _, n in seqs], tables,
                                   num_decodes=1, block_size=PAGE, device=DEVICE)
    num_kv_heads, head_dim = LLAMA3[1], LLAMA3[2]
    gen = torch.Generator().manual_seed(6)
    new = torch.randn(6, 2, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    backend = FlashAttention(head_dim, varlen_func=documented_varlen)
    out = backend.forward(LAYER, step.q, new[:, 0], new[:, 1], step.kv_cache,
                          backend.prepare(metadata))
    slots = metadata.slot_mapping
    cache = step.kv_cache[:, LAYER]
    assert torch.equal(cache[slots // PAGE, 0, slots % PAGE], new[:, 0])
    assert torch.equal(cache[slots // PAGE, 1, slots % PAGE], new[:, 1])
    assert_matches(out.view(step.q.shape), reference(step), torch.bfloat16)


def test_block_size_and_dtype_are_checked() -> None:
    step = make_step([(1, 20), (1, 9)], BUILTIN, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttention(64, varlen_func=documented_varlen).prepare(step.metadata())
    with pytest.raises(ValueError, match="block_size to be a multiple of 256, got 16"):
        EngineConfig(attention_backend="flash_attn", dtype="bfloat16")
    with pytest.raises(ValueError, match="needs dtype bfloat16 or float16"):
        EngineConfig(attention_backend="flash_attn", block_size=256)
    # tandem up / YAML / the chart: flash_attn without a block size gets flash-attn's page.
    config = AppConfig.from_dict({"attention_backend": "flash_attn"})
    assert config.block_size == PAGE
    assert AppConfig.from_dict({"attention_backend": "flash_attn",
                                "block_size": 512}).block_size == 512
    with pytest.raises(ConfigError, match="block_size to be a multiple of 256"):
        AppConfig.from_dict({"attention_backend": "flash_attn", "block_size": 16})


@pytest.mark.skipif(HAS_FLASH, reason="flash_attn is installed here")
def test_choosing_flash_attn_without_the_package_says_so() -> None:
    with pytest.raises(ValueError, match="needs the flash_attn package"):
        resolve_backend("flash_attn", "cuda")


@pytest.mark.skipif(not HAS_FLASH, reason="needs the flash_attn package and a CUDA GPU "
                                          "(no CPU build exists)")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_real_flash_attn_matches_reference(scenario: str) -> None:
    seqs, heads, shared = SCENARIOS[scenario]
    step = make_step(seqs, heads, PAGE, torch.bfloat16, shared_prefix_blocks=shared)
    backend = FlashAttention(heads[2])
    no_new = step.q.new_empty(0, heads[1], heads[2])
    out = backend.forward(LAYER, step.q, no_new, no_new, step.kv_cache,
                          backend.prepare(step.metadata()))
    assert_matches(out.view(step.q.shape), reference(step), torch.bfloat16)
