from __future__ import annotations

import math

from services.engine.sampling_params import SamplingParams


def chat(engine, text):  # type: ignore[no-untyped-def]
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_seeded_sampling_is_reproducible_and_seeds_differ(make_engine):
    engine = make_engine()
    prompt = chat(engine, "Tell me a story about a robot.")
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
              for s in (7, 7, 8)]
    a, b, c = engine.generate([prompt] * 3, params)
    assert a == b, "the same seed must give the same tokens"
    assert a != c, "different seeds should give different tokens"
    # Reproducible across engines and regardless of what else is in the batch.
    other = make_engine()
    alone = other.generate([prompt], params[0])[0]
    assert alone == a


def test_top_k_one_and_tiny_top_p_are_greedy(make_engine):
    engine = make_engine()
    prompt = chat(engine, "List three fruits.")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    top_k = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.5, top_k=1,
                                                     seed=1))[0]
    top_p = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.5,
                                                     top_p=1e-6, seed=2))[0]
    assert greedy == top_k == top_p


def test_logprobs_of_sampled_token_and_top_n(make_engine):
    engine = make_engine()
    prompt = chat(engine, "Say hello.")
    engine.add_request("lp", prompt, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.extend(zip(out.new_token_ids, out.new_logprobs, strict=True))
    assert len(seen) == 5
    for token, lp in seen:
        assert lp.token_id == token
        assert len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy: the sampled token is the best one
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0.0


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token() -> None:
    """5e-324 is 0 in float32: without the guard every token was dropped (NaN, a failed step)."""
    import torch

    from services.engine.sampler import probabilities

    logits = torch.tensor([1.0, 3.0, 2.0])
    for top_p in (5e-324, 1e-300, 1e-9):
        probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert probs.tolist() == [0.0, 1.0, 0.0]


def test_a_resumed_request_continues_exactly(make_engine):
    """Draws depend on (seed, position) only: an engine given a request's first tokens as
    ``output_token_ids`` (a migration) emits exactly the rest, sampled or greedy, with or
    without speculation."""
    from services.engine.config import SpeculativeConfig

    first, other = make_engine(), make_engine(speculative=SpeculativeConfig(method="ngram"))
    prompt = chat(first, "Write a short poem about rain.")
    for params in (SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)):
        whole = first.generate([prompt], params)[0]
        for done in (1, 10):
            other.add_request(f"resumed-{done}", prompt, params, output_token_ids=whole[:done])
            rest: list[int] = []
            while other.has_unfinished_requests():
                for out in other.step():
                    rest += out.new_token_ids
            assert whole[:done] + rest == whole, (params, done)


def test_a_sampled_request_without_a_seed_gets_one(make_engine):
    engine = make_engine()
    prompt = chat(engine, "Name a colour.")
    engine.add_request("unseeded", prompt, SamplingParams(max_tokens=2, temperature=1.0))
    assert engine.scheduler.get("unseeded").sampling.seed is not None
    engine.abort_request("unseeded")
