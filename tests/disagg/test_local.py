"""Prefill and decode workers as plain objects in one process, over real NIXL and TCP:
failures, leases, rejects and aborts. Every test ends with both workers' blocks all free."""

from __future__ import annotations

import asyncio

import pytest

from tandem.services.handoff.decode import DecodeConfig, DecodeWorker, KVSource
from tandem.services.handoff.prefill import PrefillConfig, PrefillWorker
from tandem.services.protocol.outputs import (
    DecodeRejectedError,
    EngineDeadError,
    KVTransferFailedError,
)
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.disagg.cluster import (
    TRANSPORTS,
    FakeClock,
    compare_prefix,
    free_blocks,
    local_pair,
    run_request,
)

SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = 3  # 227 tokens: 15 blocks


async def all_free(p: PrefillWorker, d: DecodeWorker) -> None:
    assert await free_blocks(p) == p.engine.llm.block_manager.num_blocks
    assert await free_blocks(d) == d.engine.llm.block_manager.num_blocks
    assert len(p.leases) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corruption_is_caught_and_recomputed(loaded_model, prompts, references, transport):
    async def scenario() -> None:
        async with local_pair(loaded_model, transport) as (p, d):
            d.transport.faults.corrupt_reads = 1
            result = await run_request(p, d, "r", prompts[PROMPT], SHORT)
            assert result.kv_source is KVSource.RECOMPUTE
            compare_prefix(result.output_token_ids, references[PROMPT], "after corruption")
            assert d.metrics.checksum_failures == 1 and d.metrics.recomputes == 1
            assert p.metrics.reject_reasons == {"transfer_failed": 1}
            # The next request pulls cleanly.
            again = await run_request(p, d, "r2", prompts[PROMPT], SHORT)
            assert again.kv_source is KVSource.TRANSFER
            assert again.output_token_ids == result.output_token_ids
            await all_free(p, d)

    asyncio.run(scenario())


def test_corruption_fails_clearly_when_configured(loaded_model, prompts):
    async def scenario() -> None:
        config = DecodeConfig(verify_checksums=True, on_transfer_failure="fail")
        async with local_pair(loaded_model, "nixl", decode=config) as (p, d):
            d.transport.faults.corrupt_reads = 1
            with pytest.raises(KVTransferFailedError, match=r"CRC32 .* on_transfer_failure"):
                await run_request(p, d, "r", prompts[PROMPT], SHORT)
            assert d.metrics.recomputes == 0
            await all_free(p, d)

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_descriptor_error_recomputes(loaded_model, prompts, references, transport):
    async def scenario() -> None:
        async with local_pair(loaded_model, transport) as (p, d):
            d.transport.faults.bad_descriptor_reads = 1
            result = await run_request(p, d, "r", prompts[PROMPT], SHORT)
            assert result.kv_source is KVSource.RECOMPUTE
            compare_prefix(result.output_token_ids, references[PROMPT], "descriptor error")
            assert d.metrics.transfer_failures == 1
            await all_free(p, d)

    asyncio.run(scenario())


def test_timeout_recomputes(loaded_model, prompts, references):
    async def scenario() -> None:
        config = DecodeConfig(verify_checksums=True, transfer_timeout_s=0.5)
        async with local_pair(loaded_model, "nixl", decode=config) as (p, d):
            d.transport.faults.delay_reads_s = 60.0
            result = await run_request(p, d, "r", prompts[PROMPT], SHORT)
            assert result.kv_source is KVSource.RECOMPUTE
            compare_prefix(result.output_token_ids, references[PROMPT], "timeout")
            await all_free(p, d)

    asyncio.run(scenario())


def test_a_read_that_cannot_be_stopped_stops_the_decode_engine(loaded_model, prompts):
    """A NIXL read whose transfer cannot be released or seen to end within the settle deadline
    may still write into D's cache: D's engine stops (its health check fails, so Serve replaces
    it) and the request fails with EngineDeadError (the gateway sends it on); P's lease is
    rejected, so P frees its blocks."""
    async def scenario() -> None:
        async with local_pair(loaded_model, "nixl") as (p, d):
            d.transport.faults.unstoppable_reads = 1
            d.transport.settle_timeout_s = 0.5
            with pytest.raises(EngineDeadError, match="could not be stopped within 0.5 s"):
                await run_request(p, d, "r", prompts[PROMPT], SHORT)
            with pytest.raises(EngineDeadError, match="could not be stopped"):
                d.engine.check_health()
            assert d.metrics.transfer_failures == 1
            assert p.metrics.reject_reasons == {"transfer_failed": 1}
            assert await free_blocks(p) == p.engine.llm.block_manager.num_blocks
            assert len(p.leases) == 0

    asyncio.run(scenario())


def test_peer_gone_recomputes(loaded_model, prompts, references):
    """The prefill worker's KV server is gone (TCP: connection refused)."""
    async def scenario() -> None:
        async with local_pair(loaded_model, "tcp") as (p, d):
            first = await p.prefill(GenerationRequest("r", prompts[PROMPT], SHORT))
            await p.transport.close()
            result = await d.generate(GenerationRequest("r", prompts[PROMPT], SHORT, prefill=first))
            assert result.kv_source is KVSource.RECOMPUTE
            compare_prefix(result.output_token_ids, references[PROMPT], "peer gone")
            await all_free(p, d)  # D's reject still reached P's control side

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_mid_transfer_frees_both_sides(loaded_model, prompts, transport):
    async def scenario() -> None:
        async with local_pair(loaded_model, transport) as (p, d):
            prompt = prompts[6]  # 976 tokens: 61 blocks
            first = await p.prefill(GenerationRequest("r", prompt, SHORT))
            task = asyncio.create_task(d.generate(GenerationRequest(
                "r", prompt, SHORT, prefill=first)))
            deadline = asyncio.get_running_loop().time() + 60
            while d.phase("r") != "transferring":  # yield to every loop iteration
                assert not task.done() and asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert p.metrics.reject_reasons == {"aborted": 1}
            assert d.metrics.transfers == 0
            await all_free(p, d)

    asyncio.run(scenario())


def test_closing_a_decode_stream_aborts_the_request(loaded_model, prompts):
    async def scenario() -> None:
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        async with local_pair(loaded_model, "nixl") as (p, d):
            first = await p.prefill(GenerationRequest(
                "unread", prompts[PROMPT], long))
            stream = await d.submit(GenerationRequest(
                "unread", prompts[PROMPT], long, prefill=first))
            assert stream.kv_source is KVSource.TRANSFER
            await stream.aclose()  # before reading anything
            first = await p.prefill(GenerationRequest("read", prompts[PROMPT], long))
            stream = await d.submit(GenerationRequest("read", prompts[PROMPT], long, prefill=first))
            async for _ in stream:
                break
            await stream.aclose()
            await all_free(p, d)  # engine commands run in order: the aborts came first
            assert not d.engine.llm.has_unfinished_requests()

    asyncio.run(scenario())


def test_expired_lease_frees_blocks_and_late_pull_recomputes(loaded_model, prompts, references):
    async def scenario() -> None:
        clock = FakeClock()
        config = PrefillConfig(lease_ttl_s=30, reap_interval_s=3600, checksums=True)
        async with local_pair(loaded_model, "nixl", prefill=config, clock=clock) as (p, d):
            start = await free_blocks(p)
            first = await p.prefill(GenerationRequest("r", prompts[PROMPT], SHORT))
            assert await free_blocks(p) < start
            clock.advance(29.9)
            assert await p.expire_leases() == 0
            clock.advance(0.2)
            assert await p.expire_leases() == 1
            assert await free_blocks(p) == start and p.metrics.leases_expired == 1
            # A decode worker that shows up after expiry must not trust what it reads.
            result = await d.generate(GenerationRequest("r", prompts[PROMPT], SHORT, prefill=first))
            assert result.kv_source is KVSource.RECOMPUTE
            compare_prefix(result.output_token_ids, references[PROMPT], "late pull")
            assert p.metrics.late_messages == 1
            await all_free(p, d)

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_without_room_queues_the_prompt_and_refuses_only_when_draining(
        loaded_model, prompts, references, transport):
    """No free blocks for the import: D frees P's lease at once and queues the prompt to
    prefill itself when blocks free up, so a request is never refused after its first token."""
    async def scenario() -> None:
        async with local_pair(loaded_model, transport,
                              decode_engine={"num_kv_blocks": 20}) as (p, d):
            hog = GenerationRequest("hog", prompts[4], SHORT)
            await d.engine.call(lambda e: e.begin_import(hog, 1))
            first = await p.prefill(GenerationRequest("r", prompts[PROMPT], SHORT))
            result = asyncio.ensure_future(d.generate(GenerationRequest(
                "r", prompts[PROMPT], SHORT, prefill=first)))
            while d.metrics.queued == 0:  # queued, waiting for blocks
                await asyncio.sleep(0.01)
            assert p.metrics.reject_reasons == {"no_capacity": 1}
            assert await free_blocks(p) == p.engine.llm.block_manager.num_blocks
            await d.engine.call(lambda e: e.abort_request("hog"))
            decoded = await result
            assert decoded.kv_source is KVSource.QUEUED
            compare_prefix(decoded.output_token_ids, references[PROMPT], "queued import")
            d.drain()
            first = await p.prefill(GenerationRequest("r2", prompts[0], SHORT))
            with pytest.raises(DecodeRejectedError, match="shutting down"):
                await d.generate(GenerationRequest("r2", prompts[0], SHORT, prefill=first))
            assert p.metrics.reject_reasons == {"no_capacity": 1, "shutting_down": 1}
            assert await free_blocks(p) == p.engine.llm.block_manager.num_blocks

    asyncio.run(scenario())
