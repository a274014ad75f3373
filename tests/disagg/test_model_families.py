"""Phi-3, Gemma 2 and Gemma 3 across a KV transfer: one prefill and one decode worker in this
process (TCP) on a tiny random checkpoint (tests/engine/tiny_models.py: sliding window 32;
Gemma's soft-capped logits). D's greedy tokens after pulling P's blocks equal a colocated
engine's, which match transformers: a 150-token prompt that outruns the window, then one
sharing its first 6 blocks (D reuses them from its prefix cache)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.services.engine.model_loader import load_model
from tandem.services.handoff.decode import KVSource
from tests.disagg.cluster import local_engine, local_pair, run_request
from tests.engine.helpers import outputs
from tests.engine.tiny_models import (
    GREEDY_LOGPROBS,
    assert_matches_transformers,
    random_prompt,
    save_tiny,
)


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3"])
def test_decode_after_transfer_equals_colocated(family, tmp_path, loaded_model):
    hf = save_tiny(family, tmp_path, loaded_model)
    model = load_model(tmp_path, progress=False)
    long = random_prompt(150, seed=1)
    batch = [long, long[:96] + random_prompt(40, seed=2)]
    colocated = local_engine(model)
    expected = []
    for i, prompt in enumerate(batch):
        found = outputs(colocated, prompt, GREEDY_LOGPROBS, request_id=f"c{i}")
        tokens = [t for out in found for t in out.new_token_ids]
        assert_matches_transformers(hf, prompt, tokens,
                                    [lp.logprob for out in found for lp in out.new_logprobs])
        expected.append(tokens)

    async def scenario() -> None:
        async with local_pair(model, "tcp") as (p, d):
            for i, prompt in enumerate(batch):
                result = await run_request(p, d, f"r{i}", prompt, GREEDY_LOGPROBS)
                assert result.kv_source is KVSource.TRANSFER  # checksums verified on D
                assert result.output_token_ids == expected[i]
            assert d.metrics.blocks_reused == 6  # the second prompt pulled only its new blocks
            assert d.metrics.checksum_failures == 0

    asyncio.run(scenario())
