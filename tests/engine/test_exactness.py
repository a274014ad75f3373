"""Greedy output equals transformers' through every engine path (issue: engine core)."""

from __future__ import annotations

import pytest
import torch

from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_runner import PREFILL_THREADS_MIN_TOKENS
from tandem.services.protocol.request import SamplingParams
from tests.conftest import MAX_NEW_TOKENS
from tests.hf_reference import Comparison, Reference, compare

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def check_all(outputs: list[list[int]], refs: list[Reference], label: str) -> list[Comparison]:
    results = [compare(out, ref, f"{label} prompt {i}") for i, (out, ref) in
               enumerate(zip(outputs, refs, strict=True))]
    near_ties = [r for r in results if r.near_tie_at is not None]
    # Genuine near-ties are rare: at most one prompt in eight may stop early, and the
    # comparison still covers most of the generated tokens.
    assert len(near_ties) <= 1, f"{label}: {len(near_ties)} near-tie stops is not rare"
    assert sum(r.matched for r in results) >= 0.9 * MAX_NEW_TOKENS * len(refs)
    return results


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_one_at_a_time(make_engine, prompts, references):
    engine = make_engine()
    outputs = [engine.generate([p], GREEDY)[0] for p in prompts]
    check_all(outputs, references, "sequential")
    assert_no_leak(engine)


def test_all_concurrent(make_engine, prompts, references):
    engine = make_engine(enable_prefix_caching=False)
    check_all(engine.generate(prompts, GREEDY), references, "concurrent")
    assert_no_leak(engine)


def test_prefill_steps_on_their_own_threads(make_engine, prompts, references):
    """``prefill_threads`` 2 with ``num_threads`` 1 (what a served float32 engine on two CPUs
    gets): every step computing 32+ prompt tokens runs on two torch threads, every decode step
    on one, and the outputs stay transformers'."""
    before = torch.get_num_threads()
    try:
        engine = make_engine(num_threads=1, prefill_threads=2)
        seen: list[tuple[int, int]] = []  # (rows, torch threads) per step
        engine.runner.model.register_forward_pre_hook(
            lambda model, args: seen.append((args[0].numel(), torch.get_num_threads())))
        outputs = [engine.generate([p], GREEDY)[0] for p in prompts[:4]]
        check_all(outputs, references[:4], "prefill threads")
        assert torch.get_num_threads() == 1
        assert {threads for rows, threads in seen if rows >= PREFILL_THREADS_MIN_TOKENS} == {2}
        assert {threads for rows, threads in seen if rows == 1} == {1}
        assert_no_leak(engine)
    finally:
        torch.set_num_threads(before)


# 512 is the default budget: test_all_concurrent runs it. Chunks of 16 (many steps per prompt)
# run every other prompt of the set, to keep CI short; 64 runs them all.
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_sizes(make_engine, prompts, references, chunk):
    step = 2 if chunk == 16 else 1
    engine = make_engine(max_num_batched_tokens=chunk)
    check_all(engine.generate(prompts[::step], GREEDY), references[::step], f"chunk {chunk}")
    assert_no_leak(engine)


def test_shared_prefix_with_prefix_cache(make_engine, prefix_prompts, prefix_references):
    engine = make_engine(enable_prefix_caching=True)
    # The first prompt warms the cache; the rest run together and hit its prefix blocks.
    first = engine.generate(prefix_prompts[:1], GREEDY)
    hits_before = engine.block_manager.stats.hits
    rest = engine.generate(prefix_prompts[1:], GREEDY)
    check_all(first + rest, prefix_references, "prefix cache")
    shared_blocks = 600 // engine.config.block_size
    assert engine.block_manager.stats.hits - hits_before >= 7 * shared_blocks * 16
    # Repeating a prompt hits every full block of it.
    again = engine.generate(prefix_prompts[:1], GREEDY)
    compare(again[0], prefix_references[0], "repeat")
    assert_no_leak(engine)


def test_preemption_under_small_kv_budget(make_engine, prompts, references):
    engine = make_engine(num_kv_blocks=100, max_num_batched_tokens=256)
    check_all(engine.generate(prompts, GREEDY), references, "preemption")
    assert engine.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert_no_leak(engine)
