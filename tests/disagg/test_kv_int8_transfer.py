"""int8 KV caches between workers: a prompt's blocks move with their scales, byte for byte, over
NIXL and TCP; a prefill worker with an int8 cache and a decode worker with the model's dtype
refuse to pair, naming the setting."""

from __future__ import annotations

import asyncio

import pytest

from tandem.services.engine.kv_cache import QuantizedKV, kv_storage
from tandem.services.handoff.decode import KVSource
from tandem.services.handoff.pairing import PairingError
from tandem.services.protocol.request import SamplingParams
from tests.disagg.cluster import TRANSPORTS, local_pair, run_request

INT8 = {"kv_cache_dtype": "int8"}
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = 3  # 227 tokens: 14 full blocks


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_int8_blocks_and_scales_move_exactly(loaded_model, prompts, transport):
    async def scenario() -> None:
        async with local_pair(loaded_model, transport, prefill_engine=INT8,
                              decode_engine=INT8) as (p, d):
            result = await run_request(p, d, "r", prompts[PROMPT], SHORT)
            assert result.kv_source is KVSource.TRANSFER  # checksums on: verified on D
            assert d.metrics.checksum_failures == 0
            p_cache, d_cache = p.engine.llm.kv_cache, d.engine.llm.kv_cache
            assert isinstance(p_cache, QuantizedKV) and isinstance(d_cache, QuantizedKV)
            p_blocks = p.engine.llm.block_manager.cached_blocks
            d_blocks = d.engine.llm.block_manager.cached_blocks
            shared = [h for h in p_blocks if h in d_blocks]
            assert len(shared) == len(prompts[PROMPT]) // 16  # every full prompt block
            for block_hash in shared:
                src, dst = p_blocks[block_hash], d_blocks[block_hash]
                assert kv_storage(p_cache)[src].equal(kv_storage(d_cache)[dst])
                assert p_cache.values[src].equal(d_cache.values[dst])
                assert p_cache.scales[src].equal(d_cache.scales[dst])
                assert bool((d_cache.scales[dst] > 0).all())  # real scales, not zeros

    asyncio.run(scenario())


def test_int8_prefill_and_auto_decode_refuse_to_pair(loaded_model):
    async def scenario() -> None:
        async with local_pair(loaded_model, "tcp", prefill_engine=INT8, pair=False) as (p, d):
            with pytest.raises(PairingError, match=r"KV cache dtype \(kv_cache_dtype\) differs "
                                                   r"\(p0: 'int8', d0: 'auto'\)"):
                await d.pair(p)
            assert not d.transport.has_peer("p0") and not p.peers

    asyncio.run(scenario())
