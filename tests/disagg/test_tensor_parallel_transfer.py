"""Tensor parallelism across a KV transfer (two-rank engines: two processes over gloo), over
the real transports. Blocks travel in the canonical layout: a two-rank prefill worker gathers
each pinned block's heads from both ranks into staging blocks that its transport serves; a
two-rank decode worker pulls into staging blocks and scatters them to both ranks at commit.
D's greedy tokens equal a colocated one-rank engine's whichever side has two ranks, float32
and int8 KV alike. A prefill whose staging is full ends without a lease and D recomputes
the prompt (still exact); releasing or expiring a lease frees its staging blocks."""

from __future__ import annotations

import asyncio

import pytest

from tandem.services.engine.kv_cache import kv_storage
from tandem.services.handoff.decode import KVSource
from tandem.services.handoff.prefill import PrefillConfig
from tandem.services.handoff.staging import TransferArea
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.disagg.cluster import FakeClock, free_blocks, local_engine, local_pair, run_request
from tests.engine.helpers import chat

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TWO_RANKS = {"tensor_parallel_size": 2, "num_threads": 1, "max_model_len": 512}
INT8 = {"kv_cache_dtype": "int8"}


# The staging does not depend on the transport (both move blocks by index): NIXL with float32
# blocks, TCP with int8 blocks and their scales.
@pytest.mark.parametrize(("transport", "kv"), [("nixl", {}), ("tcp", INT8)],
                         ids=["nixl", "tcp-int8"])
def test_one_rank_prefill_feeds_two_rank_decode_exactly(loaded_model, prompts, transport, kv):
    colocated = local_engine(loaded_model, **kv)
    long = prompts[3]  # 227 tokens: 14 full blocks and a partial one
    follow_up = long[:160] + chat(colocated, "Now say it in French.")  # 10 blocks cached on D
    batch = [long, follow_up, prompts[0]]
    expected = colocated.generate(batch, GREEDY)

    async def scenario() -> None:
        async with local_pair(loaded_model, transport, prefill_engine=kv,
                              decode_engine={**TWO_RANKS, **kv}) as (p, d):
            llm, area = d.engine.llm, d.area
            assert area.staged and llm.local_kv_spec.num_kv_heads == 2  # of 3
            for i, prompt in enumerate(batch):
                result = await run_request(p, d, f"r{i}", prompt, GREEDY)
                assert result.kv_source is KVSource.TRANSFER  # checksums verified on D
                assert result.output_token_ids == expected[i]
            assert d.metrics.blocks_reused == 10  # the follow-up pulled only its new blocks
            assert d.metrics.checksum_failures == 0
            assert area.num_free == kv_storage(area.cache).shape[0]  # all back

    asyncio.run(scenario())


def all_staging_free(area: TransferArea) -> bool:
    assert area.staged
    return area.num_free == area.num_staging == kv_storage(area.cache).shape[0]


# P with two ranks, D with one (NIXL) and with two (TCP): float32.
@pytest.mark.parametrize(("transport", "decode_ranks"), [("nixl", 1), ("tcp", 2)],
                         ids=["nixl-d1", "tcp-d2"])
def test_two_rank_prefill_feeds_decode_exactly(loaded_model, prompts, transport, decode_ranks):
    colocated = local_engine(loaded_model)
    long = prompts[3]  # 227 tokens: 14 full blocks and a partial one
    follow_up = long[:160] + chat(colocated, "Now say it in French.")  # 10 blocks cached on D
    batch = [long, follow_up, prompts[0]]
    expected = colocated.generate(batch, GREEDY)
    decode_engine = TWO_RANKS if decode_ranks == 2 else {}

    async def scenario() -> None:
        async with local_pair(loaded_model, transport, prefill_engine=TWO_RANKS,
                              decode_engine=decode_engine) as (p, d):
            llm = p.engine.llm
            assert p.area.staged and llm.local_kv_spec.num_kv_heads == 2  # of 3
            start = await free_blocks(p)
            for i, prompt in enumerate(batch):
                result = await run_request(p, d, f"r{i}", prompt, GREEDY)
                assert result.kv_source is KVSource.TRANSFER  # checksums verified on D
                assert result.output_token_ids == expected[i]
            assert d.metrics.blocks_reused == 10  # the follow-up pulled only its new blocks
            assert d.metrics.checksum_failures == 0
            assert p.metrics.leases_released == 3 and len(p.leases) == 0
            assert all_staging_free(p.area) and await free_blocks(p) == start
            if decode_ranks == 2:
                assert all_staging_free(d.area)

    asyncio.run(scenario())


def test_full_staging_means_no_lease_and_decode_recomputes(loaded_model, prompts):
    """P's staging (a quarter of 160 blocks: 40) holds two 15-block prompts; a third gets no
    lease, D prefills it itself, exactly. A release and an expiry each free their staging."""
    colocated = local_engine(loaded_model)
    long = prompts[3]
    expected = colocated.generate([long], GREEDY)[0]
    clock = FakeClock()

    async def scenario() -> None:
        async with local_pair(loaded_model, "nixl", prefill_engine=TWO_RANKS, clock=clock,
                              prefill=PrefillConfig(checksums=True, lease_ttl_s=30.0,
                                                    reap_interval_s=3600.0)) as (p, d):
            area = p.area
            assert area.staged and kv_storage(area.cache).shape[0] == 40
            start = await free_blocks(p)
            held = [await p.prefill(GenerationRequest(
                f"held{i}", long, GREEDY), reader="d0") for i in range(2)]
            assert all(h.kv is not None and len(h.kv.block_ids) == 15 for h in held)
            assert area.num_free == 10
            first = await p.prefill(GenerationRequest("r0", long, GREEDY), reader="d0")
            assert first.kv is None and not first.finished and p.metrics.unstaged == 1
            assert p.metrics.leases_granted == 2 and area.num_free == 10
            result = await d.generate(GenerationRequest("r0", long, GREEDY, prefill=first))
            assert result.kv_source is KVSource.RECOMPUTE
            assert result.output_token_ids == expected
            assert d.metrics.recomputes == 1
            assert held[0].kv is not None and held[1].kv is not None
            assert await p.release(held[0].kv.lease_id, "d0")
            assert area.num_free == 25
            clock.advance(31.0)
            assert await p.expire_leases() == 1
            assert all_staging_free(area) and await free_blocks(p) == start
            assert await free_blocks(d) == d.engine.llm.block_manager.num_blocks

    asyncio.run(scenario())


def test_full_decode_staging_queues_the_import_and_stays_exact(loaded_model, prompts):
    """D's staging (two ranks: a quarter of 160 blocks, 40) mostly held by other imports: a
    request's 15 blocks find no room, so its lease is rejected (P frees the blocks at once) and
    D prefills the prompt itself after its first token, exactly; every staging block comes
    back."""
    colocated = local_engine(loaded_model)
    long = prompts[3]  # 227 tokens: 15 blocks
    expected = colocated.generate([long], GREEDY)[0]

    async def scenario() -> None:
        async with local_pair(loaded_model, "tcp", decode_engine=TWO_RANKS) as (p, d):
            area = d.area
            assert area.staged and area.num_staging == 40
            held = await d.engine.call(lambda _: area.reserve("other", list(range(30))))
            assert held is not None and area.num_free == 10
            start = await free_blocks(p)
            result = await run_request(p, d, "r0", long, GREEDY)
            assert result.kv_source is KVSource.QUEUED
            assert result.output_token_ids == expected
            assert d.metrics.queued == 1 and d.metrics.rejects["no_capacity"] == 1
            assert p.metrics.leases_rejected == 1 and len(p.leases) == 0
            assert await free_blocks(p) == start
            assert area.num_free == 10  # the refused import took none
            await d.engine.call(lambda _: area.free("other"))
            assert all_staging_free(area)

    asyncio.run(scenario())
