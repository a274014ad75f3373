"""The engine's disaggregation hooks, with blocks copied tensor to tensor (no transport)."""

from __future__ import annotations

import pytest

from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.outputs import EngineOverloadedError, PinnedKV, RequestError
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.disagg.cluster import local_engine

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prefill(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[int, PinnedKV]:
    engine.add_request(GenerationRequest(request_id, prompt, PARAMS), prefill_only=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished
            assert out.kv is not None
            return out.new_token_ids[0], out.kv
    raise AssertionError("no output")


def decode_all(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            tokens.extend(out.new_token_ids)
    return tokens


def test_prefill_pins_until_release(loaded_model, prompts):
    engine = local_engine(loaded_model)
    prompt = prompts[3]
    first, kv = prefill(engine, "p", prompt)
    assert kv.num_tokens == len(prompt)
    assert len(kv.block_ids) == -(-len(prompt) // engine.config.block_size)
    assert engine.stats.num_pinned == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - len(
        kv.block_ids)
    with pytest.raises(RequestError, match="in use"):
        engine.add_request(GenerationRequest("p", prompt, PARAMS))
    assert engine.release_kv("p")
    assert not engine.release_kv("p")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The prompt's full blocks stay in the prefix cache: the next prefill hits them.
    engine.add_request(GenerationRequest("again", prompt, PARAMS), prefill_only=True)
    engine.step()
    assert engine.block_manager.stats.hits >= len(prompt) // 16 * 16
    assert engine.abort_request("again")  # abort frees a pinned request too
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_import_joins_batch_and_matches_single_engine(loaded_model, prompts):
    prompt = prompts[1]  # 37 tokens: two full blocks and a partial one
    single = local_engine(loaded_model).generate([prompt], PARAMS)[0]
    p, d = local_engine(loaded_model), local_engine(loaded_model)
    first, kv = prefill(p, "r", prompt)
    assert first == single[0]

    slot = d.begin_import(GenerationRequest("r", prompt, PARAMS), first)
    assert slot.num_cached_blocks == 0 and len(slot.block_ids) == len(kv.block_ids)
    assert not d.has_unfinished_requests()  # importing requests are not scheduled
    d.kv_cache[list(slot.block_ids)] = p.kv_cache[list(kv.block_ids)]
    d.commit_import("r")
    assert [first, *decode_all(d, "r")] == single

    # The imported full blocks entered D's prefix cache: a second import reuses them.
    slot = d.begin_import(GenerationRequest("r2", prompt, PARAMS), first)
    assert slot.num_cached_blocks == len(prompt) // d.config.block_size
    d.kv_cache[list(slot.block_ids[slot.num_cached_blocks:])] = p.kv_cache[
        list(kv.block_ids[slot.num_cached_blocks:])]
    d.commit_import("r2")
    assert [first, *decode_all(d, "r2")] == single
    assert d.block_manager.num_free_blocks == d.block_manager.num_blocks


def test_recompute_and_abort_import(loaded_model, prompts):
    prompt = prompts[1]
    single = local_engine(loaded_model).generate([prompt], PARAMS)[0]
    d = local_engine(loaded_model, enable_prefix_caching=False)
    d.begin_import(GenerationRequest("r", prompt, PARAMS), single[0])  # blocks left unfilled
    d.recompute_import("r")
    assert [single[0], *decode_all(d, "r")] == single
    d.begin_import(GenerationRequest("gone", prompt, PARAMS), single[0])
    assert d.abort_request("gone")
    with pytest.raises(RequestError, match="no KV import"):
        d.commit_import("gone")
    assert d.block_manager.num_free_blocks == d.block_manager.num_blocks


def test_import_without_room_is_refused(loaded_model, prompts):
    d = local_engine(loaded_model, num_kv_blocks=20)
    d.begin_import(GenerationRequest("first", prompts[4], PARAMS), 1)  # 153 tokens: 10 blocks
    with pytest.raises(EngineOverloadedError, match="no room"):
        d.begin_import(GenerationRequest("second", prompts[3], PARAMS), 1)  # 227 tokens: 15 blocks
    assert list(d.requests) == ["first"] and d.stats.num_importing == 1
    assert d.block_manager.num_free_blocks == 10
