"""A prefill worker with one rank feeding a decode worker with two (tensor_parallel_size 2, two
processes over gloo), over the real transports: the blocks arrive in the canonical layout in
D's staging blocks and are scattered to both ranks' heads at commit; D's greedy tokens equal a
colocated one-rank engine's, float32 and int8 KV alike. A prefill worker with two ranks is
refused by name."""

from __future__ import annotations

import asyncio

import pytest

from services.decode.worker import KVSource
from services.engine.kv_cache import kv_storage
from services.engine.sampling_params import SamplingParams
from services.kv_transfer.factory import make_transport
from services.prefill.worker import PrefillWorker
from tests.disagg.cluster import local_engine, local_pair, run_request
from tests.engine.helpers import chat

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TWO_RANKS = {"tensor_parallel_size": 2, "num_threads": 1}
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
            llm = d.engine.llm
            assert llm.staging is not None and llm.local_kv_spec.num_kv_heads == 2  # of 3
            for i, prompt in enumerate(batch):
                result = await run_request(p, d, f"r{i}", prompt, GREEDY)
                assert result.kv_source is KVSource.TRANSFER  # checksums verified on D
                assert result.output_token_ids == expected[i]
            assert d.metrics.blocks_reused == 10  # the follow-up pulled only its new blocks
            assert d.metrics.checksum_failures == 0
            assert len(llm._free_staging) == kv_storage(llm.staging).shape[0]  # all back

    asyncio.run(scenario())


def test_two_rank_prefill_is_refused(loaded_model):
    engine = local_engine(loaded_model, **TWO_RANKS)
    try:
        with pytest.raises(ValueError, match="a prefill worker needs tensor_parallel_size 1 "
                                             r"\(got 2\)"):
            PrefillWorker(engine, make_transport("tcp", "p0"))
    finally:
        engine.close()
