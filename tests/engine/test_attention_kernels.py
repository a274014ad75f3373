"""Triton paged-attention kernels against a dense torch reference.

Without CUDA the kernels run under the Triton interpreter on CPU tensors, which is slow (Python
per program and op), so shapes stay small. The interpreter reads TRITON_INTERPRET when
``@triton.jit`` decorates, hence the environment is set before the kernels module is imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.services.engine.attention.triton_kernels import (  # noqa: E402
    choose_num_splits,
    paged_attention,
    store_kv,
)
from tests.engine.paged_layouts import (  # noqa: E402
    BUILTIN,
    DEVICE,
    LAYER,
    LLAMA3,
    MHA,
    NUM_LAYERS,
    Step,
    assert_matches,
    make_step,
    reference,
)


def attend(step: Step, num_splits: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    return paged_attention(step.q, step.kv_cache, LAYER, step.query_start, step.seq_lens,
                           step.block_tables, step.max_query_len, step.max_seq_len,
                           step.scale, num_splits=num_splits, out=out)



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
    assert_matches(attend(step), reference(step), dtype)


@pytest.mark.parametrize(("seqs", "heads", "splits"), [
    ([(1, 1), (1, 40), (1, 160), (1, 97)], BUILTIN, (4, 3)),  # short ones get empty splits
    ([(4, 150), (4, 66)], LLAMA3, (4,)),
    ([(20, 20 + 100), (1, 90)], MHA, (2,)),
], ids=["decode", "speculative", "prefill_chunk"])
def test_split_kv_matches_single_pass(seqs: list[tuple[int, int]], heads: tuple[int, int, int],
                                      splits: tuple[int, ...]) -> None:
    step = make_step(seqs, heads, block_size=16, seed=1)
    single = attend(step, num_splits=1)
    assert_matches(single, reference(step), torch.float32)
    for num_splits in splits:
        torch.testing.assert_close(attend(step, num_splits=num_splits), single,
                                   atol=1e-5, rtol=1e-5)


def test_split_kv_in_bfloat16() -> None:
    step = make_step([(1, 120), (1, 7), (2, 90)], LLAMA3, block_size=16, dtype=torch.bfloat16)
    assert_matches(attend(step, num_splits=4), reference(step), torch.bfloat16)


def test_writes_into_out() -> None:
    step = make_step([(1, 30), (3, 21)], BUILTIN, block_size=16)
    out = torch.full((8, *step.q.shape[1:]), float("nan"), device=DEVICE)[::2]  # strided
    assert attend(step, out=out) is out
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
    assert_matches(attend(step), reference(step), torch.bfloat16)


def test_choose_num_splits() -> None:
    # Prefill-sized queries and short contexts: one pass.
    assert choose_num_splits(1, 8, 128, 8192) == 1
    assert choose_num_splits(1, 8, 1, 120) == 1
    # Few long decodes: split, as a power of two, at most 64, each at least 64 keys.
    few = choose_num_splits(2, 8, 1, 8192)
    assert 1 < few <= 64 and few & (few - 1) == 0
    assert choose_num_splits(1, 1, 1, 1 << 20) == 64
    assert choose_num_splits(1, 8, 1, 1025) == 16
    # Speculative verification still counts as decode-sized.
    assert choose_num_splits(2, 8, 4, 8192) == few
    # Two (sequence, KV head) programs per SM: no split.
    assert choose_num_splits(64, 8, 1, 8192) == 1
    # Fewer splits as the batch grows.
    assert choose_num_splits(8, 8, 1, 8192) <= few
