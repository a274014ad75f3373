"""Speculative decoding changes no output (issue: speculative decoding).

Greedy: every proposer gives transformers' tokens, alone and with 8 sequences together, and
leaves no KV block behind after rejections, aborts and preemptions. Sampling: see
test_spec_distribution.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.services.engine.config import EngineConfig, SpeculativeConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.engine.test_exactness import GREEDY, check_all

PROPOSERS = ["ngram", "draft", "self"]


@pytest.fixture(scope="module")
def draft_model(loaded_model: LoadedModel) -> LoadedModel:
    """A different model over the same tokenizer: the target's weights rounded to bfloat16
    (like a quantised draft), so it agrees with the target mostly, not always."""
    weights = {name: w.to(torch.bfloat16).float() for name, w in loaded_model.weights.items()}
    return dataclasses.replace(loaded_model, weights=weights)


@pytest.fixture(scope="module")
def make_spec_engine(loaded_model: LoadedModel, draft_model: LoadedModel):  # type: ignore[no-untyped-def]
    def make(method: str, **engine_overrides: object) -> LLMEngine:
        spec = SpeculativeConfig(method=method, k=4, adaptive=False)
        config = EngineConfig(**{"num_kv_blocks": 1024, "speculative": spec,  # type: ignore[arg-type]
                                 **engine_overrides})
        return LLMEngine(config, loaded_model, draft=draft_model if method == "draft" else None)

    return make


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.proposer is not None
    draft_free = engine.proposer.num_free_blocks()
    if draft_free is not None:
        draft = engine.proposer.blocks  # type: ignore[attr-defined]
        assert draft_free == draft.num_blocks, "the draft model's KV cache leaked blocks"


@pytest.mark.parametrize("method", PROPOSERS)
def test_greedy_alone_matches_transformers(make_spec_engine, prompts, references, method):
    # Every other prompt (14 to 976 tokens): one at a time costs a run each; the concurrent
    # test below takes all eight.
    engine = make_spec_engine(method)
    outputs = [engine.generate([p], GREEDY)[0] for p in prompts[::2]]
    check_all(outputs, references[::2], f"{method}, one at a time")
    stats = engine.stats
    assert stats.spec_steps > 0 and stats.spec_draft_tokens > 0, "nothing was speculated"
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    if method == "draft":  # the bfloat16 copy agrees with its float32 target almost always
        assert stats.spec_accepted_tokens > 0.8 * stats.spec_draft_tokens
    assert_no_leak(engine)


@pytest.mark.parametrize("method", PROPOSERS)
def test_greedy_concurrent_matches_transformers(make_spec_engine, prompts, references, method):
    engine = make_spec_engine(method, enable_prefix_caching=False)
    check_all(engine.generate(prompts, GREEDY), references, f"{method}, 8 concurrent")
    assert engine.stats.spec_draft_tokens > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_preemption_and_aborts_mid_speculation_free_every_block(make_spec_engine, prompts,
                                                                 references, method):
    engine = make_spec_engine(method, num_kv_blocks=100, max_num_batched_tokens=256)
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(GenerationRequest(request_id, prompt, GREEDY))
    aborted = {"r1", "r6"}
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            # Abort mid-decode: after a few tokens, with drafts likely in flight.
            if out.request_id in aborted and len(outputs[out.request_id]) >= 3:
                assert not out.finished
                assert engine.abort_request(out.request_id)
    assert engine.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.stats.spec_draft_tokens > 0
    assert all(len(outputs[i]) < GREEDY.max_tokens for i in aborted)
    kept = [i for i, request_id in enumerate(ids) if request_id not in aborted]
    check_all([outputs[ids[i]] for i in kept], [references[i] for i in kept],
              f"{method} with preemption and aborts")
    assert_no_leak(engine)


def test_per_request_opt_out_and_cap(make_spec_engine, prompts, references):
    engine = make_spec_engine("ngram")
    off = dataclasses.replace(GREEDY, speculative=False)
    check_all([engine.generate([prompts[5]], off)[0]], [references[5]], "opted out")
    assert engine.stats.spec_draft_tokens == 0
    capped = dataclasses.replace(GREEDY, num_speculative_tokens=1)
    check_all([engine.generate([prompts[5]], capped)[0]], [references[5]], "k=1")
    stats = engine.stats
    assert stats.spec_draft_tokens == stats.spec_steps > 0, "k=1 drafts one token a step"


def test_stop_token_inside_accepted_drafts(make_spec_engine, prompts, references):
    """A stop token among accepted drafts ends the output there, as without speculation."""
    ref = references[7].tokens
    stop_at = 20
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(ref[stop_at],))
    expected = ref[:ref.index(ref[stop_at]) + 1]
    engine = make_spec_engine("draft")
    assert engine.generate([prompts[7]], params)[0] == expected
    limited = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompts[7]], limited)[0] == ref[:7]
    assert_no_leak(engine)
