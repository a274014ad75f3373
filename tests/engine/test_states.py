"""Request statuses owned by the scheduler, and KV events drained with take_events()."""

from __future__ import annotations

import asyncio

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.sequence import SequenceStatus
from tandem.services.protocol.block_hash import BlockHash
from tandem.services.protocol.kv_events import BlockRemoved, BlockStored, KVEvent
from tandem.services.protocol.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def all_free(engine: LLMEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def mirror(events: list[KVEvent], held: set[BlockHash]) -> None:
    """Apply events as the router would; a removal must follow the store it undoes."""
    for event in events:
        if isinstance(event, BlockStored):
            assert held.isdisjoint(event.block_hashes)
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert held.issuperset(event.block_hashes), "removed before it was stored"
            held.difference_update(event.block_hashes)


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def status(engine: LLMEngine, request_id: str) -> SequenceStatus:
    return engine.requests[request_id].status


def test_take_events_returns_them_in_order_once(make_engine, prompts):
    engine = make_engine(num_kv_blocks=20)  # small: the second prompt evicts the first's blocks
    held: set[BlockHash] = set()
    engine.add_request(GenerationRequest("a", prompts[3], GREEDY))  # 227 tokens: 15 blocks
    run(engine)
    first = engine.take_events()
    assert first and all(isinstance(e, BlockStored) for e in first)
    assert engine.take_events() == []  # taking clears the queue
    mirror(first, held)
    engine.add_request(GenerationRequest("b", prompts[4], GREEDY))  # 153 tokens: 10 blocks
    run(engine)
    second = engine.take_events()
    assert any(isinstance(e, BlockRemoved) for e in second)
    mirror(second, held)
    assert held == set(engine.block_manager.cached_blocks)  # the mirror is exact
    # generate() is offline: it leaves no events behind.
    engine.generate([prompts[2]], GREEDY)
    assert engine.take_events() == []


def test_async_engine_hands_events_to_on_events_before_outputs(make_engine, prompts):
    engine = make_engine()
    batches: list[list[KVEvent]] = []
    async_engine = AsyncEngine(engine, on_events=batches.append)

    async def main() -> None:
        async for out in async_engine.generate(GenerationRequest("r", prompts[3], GREEDY)):
            # The step that prefilled the prompt queued its blocks' events; they were handed
            # out before the step's output reached this stream.
            assert batches, f"output {out.num_output_tokens} arrived before its events"

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=300))
    finally:
        async_engine.shutdown()
    held: set[BlockHash] = set()
    for batch in batches:
        assert batch  # never called with nothing
        mirror(batch, held)
    assert held == set(engine.block_manager.cached_blocks)
    assert engine.take_events() == []  # drained by the engine thread


def test_on_events_errors_do_not_stop_the_engine(make_engine, prompts):
    def broken(events: list[KVEvent]) -> None:
        raise RuntimeError("consumer bug")

    engine = make_engine()
    async_engine = AsyncEngine(engine, on_events=broken)

    async def main() -> list[int]:
        return [t async for out in async_engine.generate(GenerationRequest("r", prompts[3], GREEDY))
                for t in out.new_token_ids]

    try:
        tokens = asyncio.run(asyncio.wait_for(main(), timeout=300))
    finally:
        async_engine.shutdown()
    assert len(tokens) == GREEDY.max_tokens


def test_statuses_and_aborts_from_each_free_every_block(make_engine, prompts):
    engine = make_engine(num_kv_blocks=160)
    prompt = prompts[1]  # 37 tokens

    # Prefill-only: pinned after its first token, until released or aborted.
    engine.add_request(GenerationRequest("pinned", prompt, GREEDY), prefill_only=True)
    assert status(engine, "pinned") is SequenceStatus.WAITING
    (out,) = engine.step()
    assert out.finished and out.kv is not None
    first = out.new_token_ids[0]
    assert status(engine, "pinned") is SequenceStatus.PINNED
    assert engine.stats.num_pinned == 1 and not engine.has_unfinished_requests()
    engine.add_request(GenerationRequest("released", prompt, GREEDY), prefill_only=True)
    engine.step()
    assert engine.stats.num_pinned == 2
    assert engine.release_kv("released") and "released" not in engine.requests
    assert not engine.release_kv("released")

    # An import: waiting for remote KV, then queued holding its KV, then running.
    engine.begin_import(GenerationRequest("importing", prompt, GREEDY), first)
    assert status(engine, "importing") is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert engine.stats.num_importing == 1 and not engine.has_unfinished_requests()
    assert not engine.release_kv("importing")  # not pinned: nothing happens
    engine.begin_import(GenerationRequest("imported", prompt, GREEDY), first)
    engine.commit_import("imported")
    assert status(engine, "imported") is SequenceStatus.WAITING_WITH_KV
    assert engine.stats.num_importing == 1 and engine.stats.num_waiting == 1
    engine.begin_import(GenerationRequest("running", prompt, GREEDY), first)
    engine.commit_import("running")
    engine.begin_import(GenerationRequest("recomputed", prompt, GREEDY), first)
    engine.recompute_import("recomputed")
    recomputed = engine.requests["recomputed"]
    assert recomputed.status is SequenceStatus.WAITING and recomputed.block_ids == []
    assert recomputed.num_computed_tokens == 0

    # Abort "imported" while it waits; step the others once so they run.
    assert engine.abort_request("imported")
    engine.step()
    assert status(engine, "running") is SequenceStatus.RUNNING
    assert status(engine, "recomputed") is SequenceStatus.RUNNING
    assert engine.stats.num_running == 2 and engine.stats.num_waiting == 0

    for request_id in ("pinned", "importing", "running", "recomputed"):
        assert engine.abort_request(request_id)
        assert not engine.abort_request(request_id)
    assert engine.requests == {} and all_free(engine)
    stats = engine.stats
    assert (stats.num_pinned, stats.num_importing, stats.num_running, stats.num_waiting) == (
        0, 0, 0, 0)


def test_finished_requests_leave_the_scheduler(make_engine, prompts):
    engine = make_engine()
    engine.begin_import(GenerationRequest("r", prompts[1], GREEDY), 1)
    engine.commit_import("r")
    run(engine)
    engine.add_request(GenerationRequest("p", prompts[0], GREEDY), prefill_only=True)
    run(engine)
    assert list(engine.requests) == ["p"] and engine.release_kv("p")
    assert engine.requests == {} and all_free(engine)


def test_stats_count_pending_prefill_blocks(make_engine, prompts):
    """The router's prefill load comes from the engine thread's stats snapshot, not from
    another thread reading the scheduler's queues."""
    engine = make_engine(max_num_batched_tokens=64)
    prompt = prompts[3]  # 227 tokens
    engine.add_request(GenerationRequest("a", prompt, GREEDY))
    assert engine.stats.pending_prefill_blocks == -(-len(prompt) // 16)
    engine.step()  # one 64-token chunk
    assert engine.stats.pending_prefill_blocks == -(-(len(prompt) - 64) // 16)
    run(engine)
    assert engine.stats.pending_prefill_blocks == 0
