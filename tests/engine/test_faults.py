"""Engine-loop faults: a failed step fails its own requests (only the one it names, when it
names one) and the engine goes on; a fatal
fault stops the engine, fails every request, refuses new ones and fails the health check; so
does a step that never returns, once it has run ``step_timeout_s`` (the health check finds it:
the engine thread is stuck).

The faults are real exceptions raised inside ``LLMEngine.step`` by the test-only hook
(``TANDEM_TEST_FAULTS``, services/engine/faults.py), on the engine's own thread.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.services.engine.async_engine import MAX_STEP_FAILURES, AsyncEngine
from tandem.services.engine.faults import (
    ENV,
    fault_hook_from_env,
    planned_faults,
    release_hung_steps,
)
from tandem.services.protocol.outputs import EngineDeadError, EngineError, RequestOutput
from tandem.services.protocol.request import GenerationRequest, SamplingParams

STEP_SEED, FATAL_SEED, HANG_SEED, BATCH_SEED = 666, 667, 668, 669
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


async def _collect(engine: AsyncEngine, request_id: str, prompt: list[int],
                   params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(GenerationRequest(request_id, prompt, params)):
        assert isinstance(out, RequestOutput)
        tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture
def faulty_engine(make_engine, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(ENV, f"step={STEP_SEED},fatal={FATAL_SEED},batch={BATCH_SEED}")
    engine = AsyncEngine(make_engine())
    yield engine
    engine.shutdown()


def test_the_hook_is_off_by_default_and_checks_its_setting() -> None:
    assert fault_hook_from_env(environ={}) is None
    with pytest.raises(ValueError, match=ENV):
        fault_hook_from_env(environ={ENV: "explode=1"})
    planned = {ENV: "decode:fatal=1, step=2, prefill:sigstop=3"}
    assert planned_faults("decode", planned) == {1: "fatal", 2: "step"}
    assert planned_faults("prefill", planned) == {2: "step", 3: "sigstop"}
    assert planned_faults(None, planned) == {2: "step"}


def test_a_step_fault_in_one_request_fails_it_alone(faulty_engine) -> None:  # type: ignore[no-untyped-def]
    """A fault that names its request (raised before any sequence's state changed) fails that
    request only: a bystander decoding in the same steps finishes with exactly its tokens."""
    llm = faulty_engine.llm
    prompt = llm.tokenizer.encode("Once upon a time")
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], long)[0]

    async def run() -> None:
        bystander = asyncio.ensure_future(_collect(faulty_engine, "bystander", prompt, long))
        while "bystander" not in llm.requests:  # running before the faulty one arrives
            await asyncio.sleep(0.01)
        bad = SamplingParams(max_tokens=8, temperature=0.5, seed=STEP_SEED)
        with pytest.raises(EngineError, match="injected step fault"):
            await _collect(faulty_engine, "bad", prompt, bad)
        assert await bystander == expected

    asyncio.run(run())
    assert faulty_engine.healthy
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(faulty_engine) -> None:  # type: ignore[no-untyped-def]
    llm = faulty_engine.llm
    prompt = llm.tokenizer.encode("The capital of France is")
    expected = llm.generate([prompt], GREEDY)[0]  # before the AsyncEngine steps it

    async def run() -> None:
        # A request that is not in the faulty step finishes; the faulty one fails clearly.
        bad = SamplingParams(max_tokens=8, temperature=0.5, seed=STEP_SEED)
        with pytest.raises(EngineError, match="failed while running request bad"):
            await _collect(faulty_engine, "bad", prompt, bad)
        assert await _collect(faulty_engine, "good", prompt) == expected

    asyncio.run(run())
    assert faulty_engine.healthy
    faulty_engine.check_health()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.requests


def test_repeated_step_failures_stop_the_engine(faulty_engine) -> None:  # type: ignore[no-untyped-def]
    """Steps that fail as a whole (no request named), several in a row: the engine stops."""
    llm = faulty_engine.llm
    prompt = llm.tokenizer.encode("Hello")
    bad = SamplingParams(max_tokens=8, temperature=0.5, seed=BATCH_SEED)

    async def run() -> None:
        for i in range(MAX_STEP_FAILURES - 1):
            with pytest.raises(EngineError):
                await _collect(faulty_engine, f"bad-{i}", prompt, bad)
        assert faulty_engine.healthy  # a good step in between resets the count
        assert await _collect(faulty_engine, "good", prompt)
        for i in range(MAX_STEP_FAILURES):
            with pytest.raises(EngineError):
                await _collect(faulty_engine, f"again-{i}", prompt, bad)

    asyncio.run(run())
    assert not faulty_engine.healthy
    with pytest.raises(EngineDeadError, match="3 failed step"):
        faulty_engine.check_health()


def test_a_fatal_fault_fails_every_request_and_refuses_new_ones(faulty_engine) -> None:  # type: ignore[no-untyped-def]
    llm = faulty_engine.llm
    prompt = llm.tokenizer.encode("Once upon a time")
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    fatal = SamplingParams(max_tokens=8, temperature=0.5, seed=FATAL_SEED)

    async def run() -> None:
        bystander = asyncio.ensure_future(_collect(faulty_engine, "bystander", prompt, long))
        stream = faulty_engine.generate(GenerationRequest("victim", prompt, fatal))
        with pytest.raises(EngineDeadError, match="injected fatal fault"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await bystander
        with pytest.raises(EngineDeadError):
            await _collect(faulty_engine, "later", prompt)
        with pytest.raises(EngineDeadError):
            await faulty_engine.call(lambda e: e.stats)

    asyncio.run(run())
    with pytest.raises(EngineDeadError, match="injected fatal fault"):
        faulty_engine.check_health()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_a_hung_step_fails_its_streams_and_the_health_check(make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A step blocked inside the model (the ``hang`` fault: the engine thread really waits) is
    found by the health check once it has run step_timeout_s: every stream ends with a clear
    error instead of waiting, new requests are refused at once, the check fails (Serve would
    replace the worker). Should the step return after all, the engine frees every block."""
    monkeypatch.setenv(ENV, f"hang={HANG_SEED}")
    engine = AsyncEngine(make_engine(step_timeout_s=0.5))
    llm = engine.llm
    prompt = llm.tokenizer.encode("The capital of France is")
    hang = SamplingParams(max_tokens=8, temperature=0.5, seed=HANG_SEED)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    async def watch(stream: asyncio.Future[list[int]]) -> None:  # as Serve's health check does
        while not stream.done():
            await asyncio.sleep(0.05)
            if not engine.healthy:
                break

    async def run() -> None:
        bystander = asyncio.ensure_future(_collect(engine, "bystander", prompt, long))
        victim = asyncio.ensure_future(_collect(engine, "victim", prompt, hang))
        started = time.monotonic()
        await asyncio.wait_for(watch(victim), 30)
        for stream in (victim, bystander):
            with pytest.raises(EngineDeadError, match="the engine is hung"):
                await asyncio.wait_for(stream, 5)
        assert time.monotonic() - started < 25  # not the stream idle timeout: the watchdog
        with pytest.raises(EngineDeadError, match="hung"):
            await asyncio.wait_for(_collect(engine, "later", prompt), 5)
        with pytest.raises(EngineDeadError, match="hung"):
            await asyncio.wait_for(engine.call(lambda e: e.stats), 5)

    try:
        asyncio.run(run())
        with pytest.raises(EngineDeadError, match=r"step_timeout_s 0.5\): the engine is hung"):
            engine.check_health()
    finally:
        release_hung_steps()  # the step returns (raising); the engine thread stops there
    deadline = time.monotonic() + 30
    while engine._thread.is_alive() and llm.requests:
        assert time.monotonic() < deadline, "the engine did not free the hung step's requests"
        time.sleep(0.05)
    engine.shutdown()
    assert not llm.requests
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
