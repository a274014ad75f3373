"""Decode rows (attention/metadata.py): the torch backend reading decoding sequences' K/V
from rows kept between steps gives the same output, bit for bit, as gathering their blocks
every step, through sequences joining and leaving, preemption and an int8 cache."""

from __future__ import annotations

import pytest

from tandem.services.engine.attention.metadata import DecodeRows
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.request import GenerationRequest, SamplingParams

# Prompts of different lengths and outputs of different lengths: sequences start and finish
# decoding at different steps, so rows are filled, moved down and given up as they go.
LENGTHS = [(5, 9), (40, 20), (17, 3), (90, 14), (33, 24), (2, 11), (64, 6), (21, 17)]


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Each request's (token, logprob) pairs, run together."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
              for _, n in LENGTHS]
    out: dict[str, list[tuple[int, float]]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerationRequest(f"r{i}", prompt, p))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(
                (t, lp.logprob) for t, lp in zip(o.new_token_ids, o.new_logprobs, strict=True))
            rows = engine.runner.decode_rows
            if rows is not None:  # dense: one row per decoding sequence, nothing stale
                assert len(rows.owners) <= engine.config.max_num_seqs
                assert None not in rows.owners
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def mixed_prompts(prompts: list[list[int]]) -> list[list[int]]:
    base = [t for p in prompts for t in p]
    return [base[7 * i:7 * i + n] for i, (n, _) in enumerate(LENGTHS)]


def gathering(engine: LLMEngine) -> LLMEngine:
    engine.runner.decode_rows = None
    return engine


@pytest.mark.parametrize("settings", [
    {},  # float32
    {"kv_cache_dtype": "int8"},
    # A small cache and batch: requests wait, and running ones are preempted and recompute.
    {"num_kv_blocks": 10, "max_num_seqs": 4, "enable_prefix_caching": False},
], ids=["float32", "int8", "preempting"])
def test_rows_equal_gathering_bit_for_bit(make_engine, mixed_prompts, settings):
    with_rows = make_engine(attention_backend="torch", **settings)
    assert with_rows.runner.decode_rows is not None
    got = run(with_rows, mixed_prompts)
    want = run(gathering(make_engine(attention_backend="torch", **settings)), mixed_prompts)
    assert got == want
    if "num_kv_blocks" in settings:
        assert with_rows.num_preemptions > 0  # the case it names happened
    assert with_rows.block_manager.num_free_blocks == with_rows.block_manager.num_blocks


def test_rows_never_read_uninitialized_memory(make_engine, mixed_prompts):
    """SDPA multiplies a shorter row's masked tail by 0: garbage there (NaN) would poison it.
    torch fills every uninitialized tensor with NaN in this mode, so a row grown from empty
    memory fails this test at once."""
    import torch

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        got = run(make_engine(attention_backend="torch"), mixed_prompts)
    finally:
        torch.use_deterministic_algorithms(False)
    assert got == run(gathering(make_engine(attention_backend="torch")), mixed_prompts)


def test_a_batch_over_the_byte_bound_gathers_instead(make_engine, mixed_prompts):
    engine = make_engine(attention_backend="torch")
    rows = engine.runner.decode_rows
    assert isinstance(rows, DecodeRows)
    rows.max_bytes = 1  # no row fits: every step gathers
    got = run(engine, mixed_prompts)
    assert rows.owners == [] and rows.data.numel() == 0
    assert got == run(gathering(make_engine(attention_backend="torch")), mixed_prompts)


def test_a_preempted_sequence_gets_a_new_key():
    from tandem.services.engine.sequence import Sequence

    seq = Sequence("r", [1, 2, 3], 3, SamplingParams(), ())
    other = Sequence("s", [1, 2, 3], 3, SamplingParams(), ())
    before = seq.kv_key
    seq.num_preemptions += 1
    assert seq.kv_key != before and other.kv_key not in (before, seq.kv_key)
