"""The prompt's logprobs (completions echo + logprobs): transformers' values, whatever the
chunking, never from a cached block, and sent once with the first output."""

from __future__ import annotations

import pytest
import torch

from tandem.services.protocol.request import SamplingParams
from tests.engine.helpers import outputs as run


@pytest.fixture(scope="module")
def prompt(prompts: list[list[int]]) -> list[int]:
    return max(prompts, key=len)[:70]  # several blocks and, at 16 a chunk, several chunks


def test_prompt_logprobs_equal_transformers_over_chunks_and_the_cache(
        make_engine, hf_model, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    expected = logits.log_softmax(-1)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    for chunk in (2048, 16):  # one chunk; five chunks
        engine = make_engine(max_num_batched_tokens=chunk, max_model_len=2048)
        found = run(engine, prompt, params, request_id="a")
        first, *rest = found
        got = first.prompt_logprobs
        assert got is not None and len(got) == len(prompt) - 1
        assert all(o.prompt_logprobs is None for o in rest)  # sent once
        for i, lp in enumerate(got):
            assert lp.token_id == prompt[i + 1]
            assert lp.logprob == pytest.approx(float(expected[i, prompt[i + 1]]), abs=2e-3), i
            top_ids = expected[i].topk(2).indices.tolist()
            assert [t for t, _ in lp.top] == top_ids, i
        # The same prompt again: its blocks are cached, but the logprobs need their logits.
        hits = engine.stats.prefix_cache_hits
        again = run(engine, prompt, params, request_id="b")[0].prompt_logprobs
        assert engine.stats.prefix_cache_hits == hits
        assert again is not None
        assert [lp.logprob for lp in again] == pytest.approx([lp.logprob for lp in got],
                                                             abs=1e-5)
        # Without prompt logprobs the cache serves it, and no logprobs are sent.
        plain = run(engine, prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id="c")
        assert plain[0].prompt_logprobs is None and plain[0].num_cached_tokens > 0


def test_bad_prompt_logprobs_are_refused() -> None:
    for value in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
