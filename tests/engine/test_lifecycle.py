"""Aborts, stops, chunk fairness and the asyncio wrapper: every block comes back."""

from __future__ import annotations

import asyncio

import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.protocol.outputs import FinishReason, RequestError
from tandem.services.protocol.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def all_free(engine) -> bool:  # type: ignore[no-untyped-def]
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_waiting_prefilling_and_decoding(make_engine, prompts):
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=2)
    engine.add_request(GenerationRequest("decoding", prompts[0], GREEDY))
    engine.add_request(GenerationRequest("prefilling", prompts[-1], GREEDY))
    engine.add_request(GenerationRequest("waiting", prompts[1], GREEDY))
    for _ in range(3):
        engine.step()
    seqs = engine.requests
    assert seqs["decoding"].num_output_tokens > 0
    assert 0 < seqs["prefilling"].num_computed_tokens < len(prompts[-1])
    assert seqs["waiting"].num_computed_tokens == 0
    for rid in ("prefilling", "decoding", "waiting"):
        assert engine.abort_request(rid)
    assert not engine.abort_request("decoding")  # unknown now
    assert all_free(engine) and not engine.has_unfinished_requests()


def test_long_prompt_never_stalls_running_sequences(make_engine, prompts):
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request(GenerationRequest("short", prompts[0], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True)))
    engine.step()  # the short prompt is prefilled and running
    engine.add_request(GenerationRequest("long", prompts[-1], GREEDY))
    long_seq = engine.requests["long"]
    steps = 0
    while long_seq.num_computed_tokens < len(prompts[-1]):
        outs = engine.step()
        steps += 1
        assert any(o.request_id == "short" for o in outs), "a decode step was skipped"
    assert steps >= len(prompts[-1]) // 64  # the long prompt really was chunked
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(engine)


def test_stop_token_and_eos_and_context_limit(make_engine):
    engine = make_engine(max_model_len=64)
    question = "What is 2+2? Answer with one number."
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
    free = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert free[-1] in engine.model_config.eos_token_ids  # the model ends its turn
    stop_at = free[2]
    engine.add_request(GenerationRequest("s", prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                   stop_token_ids=(stop_at,))))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == free[:3]
    assert outs[-1].finish_reason is FinishReason.STOP
    engine.add_request(GenerationRequest("ctx", prompt, SamplingParams(
        max_tokens=1000, temperature=0.0, ignore_eos=True)))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_prompt_tokens + outs[-1].num_output_tokens == 64
    assert all_free(engine)


def test_async_streams_match_sync_and_cancel_frees_blocks(make_engine, prompts):
    reference = make_engine().generate(prompts[:4], GREEDY)
    engine = make_engine()
    async_engine = AsyncEngine(engine)

    async def collect(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in async_engine.generate(GenerationRequest(f"r{i}", prompts[i], GREEDY)):
            tokens.extend(out.new_token_ids)
        return tokens

    async def cancel_midway() -> int:
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        stream = async_engine.generate(GenerationRequest("cancelled", prompts[5], params))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        return got

    async def main() -> tuple[list[list[int]], int]:
        results = await asyncio.gather(*(collect(i) for i in range(4)), cancel_midway())
        with pytest.raises(RequestError, match="empty"):
            async for _ in async_engine.generate(GenerationRequest("bad", [], GREEDY)):
                pass
        return list(results[:4]), results[4]

    try:
        outputs, cancelled_after = asyncio.run(asyncio.wait_for(main(), timeout=300))
        assert outputs == reference
        assert cancelled_after == 3
    finally:
        async_engine.shutdown()
    assert not engine.has_unfinished_requests() and all_free(engine)


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(make_engine, prompts):
    """A stream left open when its caller's event loop closed: the engine aborts it (no one
    can read it) and goes on serving others, its blocks freed."""
    engine = make_engine()
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def first_output() -> None:
        stream = async_engine.generate(GenerationRequest("orphan", prompts[0], params))
        await anext(stream)  # running now; the stream is never closed

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(first_output())
    finally:
        loop.close()  # without closing the stream: its outputs have nowhere to go

    async def collect() -> list[int]:
        tokens: list[int] = []
        async for out in async_engine.generate(GenerationRequest("next", prompts[1], GREEDY)):
            tokens.extend(out.new_token_ids)
        return tokens

    try:
        assert asyncio.run(asyncio.wait_for(collect(), timeout=300)) == \
            make_engine().generate(prompts[1:2], GREEDY)[0]
        async_engine.check_health()
    finally:
        async_engine.shutdown()
    assert not engine.has_unfinished_requests() and all_free(engine)
