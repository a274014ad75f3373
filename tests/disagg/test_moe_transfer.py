"""A Qwen3-MoE model disaggregated: one prefill and one decode worker in this process (TCP).
The prefill worker's first token and the decode worker's tokens after it, greedy, with their
logprobs, match a teacher-forced transformers pass (float32, logprobs within 1e-4)."""

from __future__ import annotations

import asyncio

import torch

from tandem.services.engine.model_loader import load_model
from tandem.services.handoff.decode import KVSource
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.disagg.cluster import local_pair
from tests.engine.tiny_models import assert_matches_transformers, tiny_qwen3_moe

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def test_qwen3_moe_prefill_then_decode_matches_transformers(loaded_model, tmp_path):
    hf = tiny_qwen3_moe()
    hf.save_pretrained(tmp_path)
    loaded_model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    moe = load_model(tmp_path, progress=False)
    assert moe.config.moe_layers == (0, 2)
    prompt = [int(t) for t in torch.randint(3, 49152, (150,),
                                             generator=torch.Generator().manual_seed(2))]

    async def scenario() -> tuple[list[int], list[float]]:
        async with local_pair(moe, "tcp", prefill_engine={"max_num_batched_tokens": 48}
                              ) as (p, d):
            first = await p.prefill(GenerationRequest("r", prompt, GREEDY), reader="d0")
            assert first.kv is not None and not first.finished
            tokens = [first.first_token]
            logprobs = [lp.logprob for lp in first.logprobs]
            stream = await d.submit(GenerationRequest("r", prompt, GREEDY, prefill=first))
            assert stream.kv_source is KVSource.TRANSFER
            async for out in stream:
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.new_logprobs]
            assert d.metrics.checksum_failures == 0
            return tokens, logprobs

    tokens, logprobs = asyncio.run(scenario())
    assert len(tokens) == 12
    assert_matches_transformers(hf, prompt, tokens, logprobs)
