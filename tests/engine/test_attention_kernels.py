"""Triton paged-attention kernels against a dense torch reference.

Without CUDA the kernels run under the Triton interpreter on CPU tensors, which is slow (Python
per program and op), so shapes stay small. The interpreter reads TRITON_INTERPRET when
``@triton.jit`` decorates, hence the environment is set before the kernels module is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from services.engine.attention.triton_kernels import (  # noqa: E402
    choose_num_splits,
    paged_attention,
    store_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYER = 1  # of NUM_LAYERS: a nonzero layer checks the layer stride
NUM_LAYERS = 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# Head layouts (num_heads, num_kv_heads, head_dim): GQA groups 1, 3 (the built-in model) and 4
# (Llama-3's 32/8 at head_dim 128, with fewer heads).
MHA = (4, 4, 64)
BUILTIN = (9, 3, 64)
LLAMA3 = (8, 2, 128)


@dataclass
class Step:
    q: torch.Tensor  # [T, num_heads, head_dim], a non-contiguous view
    kv_cache: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float

    def attention(self, num_splits: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(self.q, self.kv_cache, LAYER, self.query_start, self.seq_lens,
                               self.block_tables, self.max_query_len, self.max_seq_len,
                               self.scale, num_splits=num_splits, out=out)


def make_step(seqs: list[tuple[int, int]], heads: tuple[int, int, int], block_size: int,
              dtype: torch.dtype = torch.float32, shared_prefix_blocks: int = 0,
              seed: int = 0) -> Step:
    """A random cache and step: sequence s has ``seqs[s] = (query_len, seq_len)``, its blocks
    drawn in shuffled order; the first ``shared_prefix_blocks`` block ids are common to all."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks of noise that nobody may read
    ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 2, dtype=torch.int32)
    shared, used = ids[:shared_prefix_blocks], shared_prefix_blocks
    for s, n in enumerate(blocks_per_seq):
        assert n >= shared_prefix_blocks
        own = ids[used:used + n - shared_prefix_blocks]
        used += len(own)
        block_tables[s, :n] = torch.cat([shared, own]).int()

    num_tokens = sum(q_len for q_len, _ in seqs)
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    # q as the first columns of a fused qkv projection: row stride != num_heads * head_dim.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)  # slice on the device: a copy would make q contiguous
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not q.is_contiguous()
    query_start = torch.tensor([0] + [q_len for q_len, _ in seqs]).cumsum(0).int()
    return Step(q, kv_cache.to(DEVICE), query_start.to(DEVICE),
                torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32, device=DEVICE),
                block_tables.to(DEVICE), max(q for q, _ in seqs), max(n for _, n in seqs),
                head_dim ** -0.5)


def reference(step: Step) -> torch.Tensor:
    """Dense float64 attention: gather each sequence's keys, explicit causal mask."""
    q, cache = step.q.cpu().double(), step.kv_cache[:, LAYER].cpu().double()
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    bounds = step.query_start.tolist()
    for s, seq_len in enumerate(step.seq_lens.tolist()):
        start, end = bounds[s], bounds[s + 1]
        pos = torch.arange(seq_len)
        blocks = step.block_tables[s].cpu().long()[pos // block_size]
        keys = cache[blocks, 0, pos % block_size].repeat_interleave(group, dim=1)
        values = cache[blocks, 1, pos % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * step.scale
        q_pos = seq_len - (end - start) + torch.arange(end - start)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.cpu().double(), expected, atol=tol, rtol=tol)


# (query_len, seq_len) per sequence, head layout, block size, shared prefix blocks.
SCENARIOS = {
    "decode": ([(1, 1), (1, 17), (1, 64), (1, 100), (1, 33)], BUILTIN, 16, 0),
    "speculative": ([(4, 4), (4, 37), (4, 80)], LLAMA3, 16, 0),
    "prefill_chunk": ([(27, 27 + 43), (36, 36 + 30)], MHA, 8, 0),
    "fresh_prefill": ([(29, 29), (5, 5)], BUILTIN, 16, 0),
    "mixed": ([(1, 50), (1, 9), (1, 71), (33, 33 + 60), (12, 12)], LLAMA3, 32, 0),
    "shared_prefix": ([(1, 70), (4, 52), (20, 20 + 45)], BUILTIN, 16, 2),
    "large_blocks": ([(1, 90), (6, 130)], MHA, 64, 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_matches_reference(scenario: str, dtype: torch.dtype) -> None:
    seqs, heads, block_size, shared = SCENARIOS[scenario]
    step = make_step(seqs, heads, block_size, dtype, shared_prefix_blocks=shared)
    assert_matches(step.attention(), reference(step), dtype)


@pytest.mark.parametrize(("seqs", "heads", "splits"), [
    ([(1, 1), (1, 40), (1, 160), (1, 97)], BUILTIN, (4, 3)),  # short ones get empty splits
    ([(4, 150), (4, 66)], LLAMA3, (4,)),
    ([(20, 20 + 100), (1, 90)], MHA, (2,)),
], ids=["decode", "speculative", "prefill_chunk"])
def test_split_kv_matches_single_pass(seqs: list[tuple[int, int]], heads: tuple[int, int, int],
                                      splits: tuple[int, ...]) -> None:
    step = make_step(seqs, heads, block_size=16, seed=1)
    single = step.attention(num_splits=1)
    assert_matches(single, reference(step), torch.float32)
    for num_splits in splits:
        torch.testing.assert_close(step.attention(num_splits=num_splits), single,
                                   atol=1e-5, rtol=1e-5)


def test_split_kv_in_bfloat16() -> None:
    step = make_step([(1, 120), (1, 7), (2, 90)], LLAMA3, block_size=16, dtype=torch.bfloat16)
    assert_matches(step.attention(num_splits=4), reference(step), torch.bfloat16)


def test_writes_into_out() -> None:
    step = make_step([(1, 30), (3, 21)], BUILTIN, block_size=16)
    out = torch.full((8, *step.q.shape[1:]), float("nan"), device=DEVICE)[::2]  # strided
    assert step.attention(out=out) is out
    assert_matches(out, reference(step), torch.float32)


@pytest.mark.parametrize(("dtype", "slot_dtype"), [(torch.float32, torch.int64),
                                                   (torch.bfloat16, torch.int32)])
def test_store_kv_writes_exactly_the_named_slots(dtype: torch.dtype,
                                                 slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 3, 64
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11]
    kv = torch.randn(11, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # non-contiguous views, as after a split

    expected = kv_cache.clone()
    expected[slots // block_size, LAYER, 0, slots % block_size] = k.cpu()
    expected[slots // block_size, LAYER, 1, slots % block_size] = v.cpu()
    kv_cache = kv_cache.to(DEVICE)
    store_kv(kv_cache, LAYER, k, v, slots.to(slot_dtype).to(DEVICE))
    assert torch.equal(kv_cache.cpu(), expected)


def test_store_then_attend_a_mixed_step() -> None:
    """The engine's order: store the step's new k/v, then attend over the whole cache."""
    seqs = [(1, 25), (4, 41), (18, 18)]
    step = make_step(seqs, LLAMA3, block_size=16, dtype=torch.bfloat16, seed=3)
    block_size = step.kv_cache.shape[3]
    slots = []
    for s, (q_len, seq_len) in enumerate(seqs):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(step.block_tables[s, pos // block_size]) * block_size
                         + pos % block_size)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    num_kv_heads, head_dim = step.kv_cache.shape[4:]
    gen = torch.Generator().manual_seed(4)
    new = torch.randn(len(slots), 2, num_kv_heads, head_dim, generator=gen)
    new = new.to(torch.bfloat16).to(DEVICE)
    store_kv(step.kv_cache, LAYER, new[:, 0], new[:, 1], slot_mapping)
    cache = step.kv_cache[:, LAYER]
    assert torch.equal(cache[slot_mapping // block_size, 0, slot_mapping % block_size],
                       new[:, 0])
    assert_matches(step.attention(), reference(step), torch.bfloat16)


def test_choose_num_splits() -> None:
    # Prefill-sized queries and short contexts: one pass.
    assert choose_num_splits(1, 8, 128, 8192) == 1
    assert choose_num_splits(1, 8, 1, 200) == 1
    # Few long decodes: split, as a power of two, at most 16.
    few = choose_num_splits(2, 8, 1, 8192)
    assert 1 < few <= 16 and few & (few - 1) == 0
    assert choose_num_splits(1, 1, 1, 1 << 20) == 16
    # Speculative verification still counts as decode-sized.
    assert choose_num_splits(2, 8, 4, 8192) == few
    # Enough (sequence, KV head) programs to fill the SMs: no split.
    assert choose_num_splits(64, 8, 1, 8192) == 1
    # Fewer splits as the batch grows.
    assert choose_num_splits(8, 8, 1, 8192) <= few
