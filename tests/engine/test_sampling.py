from __future__ import annotations

import math

from tandem.services.protocol.request import GenerationRequest, SamplingParams


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
    engine.add_request(GenerationRequest("lp", prompt, SamplingParams(max_tokens=5,
                                                                      temperature=0.0,
                                                                      logprobs=3)))
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

    from tandem.services.engine.sampler import probabilities

    logits = torch.tensor([1.0, 3.0, 2.0])
    for top_p in (5e-324, 1e-300, 1e-9):
        probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert probs.tolist() == [0.0, 1.0, 0.0]


def test_a_resumed_request_continues_exactly(make_engine):
    """Draws depend on (seed, position) only: an engine given a request's first tokens as
    ``output_token_ids`` (a migration) emits exactly the rest, sampled or greedy, with or
    without speculation."""
    from tandem.services.engine.config import SpeculativeConfig

    first, other = make_engine(), make_engine(speculative=SpeculativeConfig(method="ngram"))
    prompt = chat(first, "Write a short poem about rain.")
    for params in (SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)):
        whole = first.generate([prompt], params)[0]
        for done in (1, 10):
            other.add_request(GenerationRequest(f"resumed-{done}", prompt, params,
                                                output_token_ids=tuple(whole[:done])))
            rest: list[int] = []
            while other.has_unfinished_requests():
                for out in other.step():
                    rest += out.new_token_ids
            assert whole[:done] + rest == whole, (params, done)


def test_a_sampled_request_without_a_seed_gets_one(make_engine):
    engine = make_engine()
    prompt = chat(engine, "Name a colour.")
    engine.add_request(GenerationRequest("unseeded", prompt,
                                         SamplingParams(max_tokens=2, temperature=1.0)))
    assert engine.scheduler.get("unseeded").sampling.seed is not None
    engine.abort_request("unseeded")


# -- The counter-based noise and the batched sampler (services/engine/sampler.py) --------------

M32 = 0xFFFFFFFF


def py_lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32 with Python ints: the reference the int64 tensor code must
    match (no overflow, no sign, in Python)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def py_hash(key: int, v: int) -> int:
    return py_lowbias32(py_lowbias32(py_lowbias32(v) ^ (key & M32)) ^ (key >> 32))


def py_noise(key: int, v: int) -> float:
    """E = -ln(u), u = ((h >> 9) + 0.5) / 2**23, rounded to float32 (struct rounds to nearest)."""
    import struct

    u = ((py_hash(key, v) >> 9) + 0.5) / 2**23
    return struct.unpack("f", struct.pack("f", -math.log(u)))[0]


def test_noise_equals_a_pure_python_reference_of_the_hash():
    import torch

    from tandem.services.engine.sampler import (
        exponential_noise,
        exponential_noise_rows,
        noise_hash,
        position_seed,
    )

    vocab = 151936  # beyond 2**17: every index bit and the CPU's chunked path are exercised
    indices = [0, 1, 2, 255, 65535, 65536, 131071, vocab - 2, vocab - 1]
    pairs = [(0, 0), (7, 0), (7, 1), (11, 1023), (-1, 5), (2**63 - 1, 0), (2**63, 3),
             (2**63 + 12345, 99), (2**64 - 1, 2**20)]
    keys = [position_seed(seed, position) for seed, position in pairs]
    keys += [0, 1, M32, 2**32, 2**62, 2**63 - 1, 2**63 - 2**32]  # keys directly: extreme halves
    hashes = noise_hash(torch.tensor(keys), vocab)
    assert torch.equal(noise_hash(torch.tensor(keys), torch.tensor(indices)), hashes[:, indices])
    noise = exponential_noise_rows(torch.tensor(keys), vocab)
    assert hashes.shape == noise.shape == (len(keys), vocab)
    assert noise.dtype == torch.float32
    for row, key in enumerate(keys):
        assert 0 <= key < 2**63
        assert hashes[row, indices].tolist() == [py_hash(key, v) for v in indices], key
        assert noise[row, indices].tolist() == [py_noise(key, v) for v in indices], key
    for row, (seed, position) in enumerate(pairs):
        assert torch.equal(exponential_noise(seed, position, vocab), noise[row])
    # Every hash of a key is a 32-bit value; the noise is finite and positive.
    assert int(hashes.min()) >= 0 and int(hashes.max()) <= M32
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0


def test_every_possible_uniform_gives_a_device_independent_float32():
    """u takes 2**23 values; -ln(u) in float64 must lie far (here > 8 float64 ulps) from every
    float32 rounding midpoint, so that any accurate float64 log (CPU or CUDA) rounds to the
    same float32: the noise is identical bit for bit on every device."""
    import torch

    u = (torch.arange(2**23, dtype=torch.float64) * 2 + 1) * 2.0**-24
    e = -torch.log(u)
    f = e.float()
    up = torch.nextafter(f, torch.tensor(float("inf"))).double()
    down = torch.nextafter(f, torch.tensor(0.0)).double()
    fd = f.double()
    margin = torch.minimum((e - (fd + up) / 2).abs(), (e - (fd + down) / 2).abs())
    ulp = torch.finfo(torch.float64).eps * e.abs()
    assert float((margin / ulp).min()) > 8
    assert float(u.min()) > 0 and float(u.max()) < 1 and float(f.min()) > 0


def chi_square_uniform_p(counts) -> float:  # type: ignore[no-untyped-def]
    import torch

    counts = counts.double().flatten()
    expected = counts.sum() / counts.numel()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((counts.numel() - 1) / 2.0), stat / 2))


def test_noise_uniforms_are_uniform_and_independent():
    """Chi-square tests (deterministic keys, p > 1e-3) on the uniforms behind the noise:
    across the vocabulary of one draw, across the positions of one vocabulary entry, and in
    pairs (neighbouring entries, neighbouring positions) for independence."""
    import torch

    from tandem.services.engine.sampler import noise_hash, position_seed

    bins = 16

    def uniform_bins(hashes):  # type: ignore[no-untyped-def]
        return hashes >> (32 - 4)  # the top 4 bits: 16 bins

    # Across the vocabulary: 4 draws of 65536 entries, 64 bins each.
    for seed, position in ((1, 0), (2, 7), (3, 1000), (2**63 + 5, 2)):
        h = noise_hash(torch.tensor([position_seed(seed, position)]), 65536)[0]
        assert chi_square_uniform_p(torch.bincount(h >> 26, minlength=64)) > 1e-3
        pairs = uniform_bins(h[0::2]) * bins + uniform_bins(h[1::2])
        assert chi_square_uniform_p(torch.bincount(pairs, minlength=bins**2)) > 1e-3
    # Across positions: entries 0, 1 and 49151 at 32768 positions of one seed.
    keys = torch.tensor([position_seed(42, i) for i in range(32768)])
    h = noise_hash(keys, torch.tensor([0, 1, 49151]))
    for column in h.T:
        assert chi_square_uniform_p(torch.bincount(column >> 26, minlength=64)) > 1e-3
        pairs = uniform_bins(column[0::2]) * bins + uniform_bins(column[1::2])
        assert chi_square_uniform_p(torch.bincount(pairs, minlength=bins**2)) > 1e-3
    # ... and entries 0 and 1 of one draw are independent of each other.
    pairs = uniform_bins(h[:, 0]) * bins + uniform_bins(h[:, 1])
    assert chi_square_uniform_p(torch.bincount(pairs, minlength=bins**2)) > 1e-3


def test_the_chi_square_helper_rejects_skew():
    import torch

    assert chi_square_uniform_p(torch.full((16,), 1000)) > 0.99
    skewed = torch.full((16,), 1000)
    skewed[0] += 300
    assert chi_square_uniform_p(skewed) < 1e-3


def test_the_cpu_sort_is_torchs_stable_descending_sort():
    import torch

    from tandem.services.engine.sampler import _sort_descending

    gen = torch.Generator().manual_seed(0)
    for vocab in (7, 5000, 70000):
        x = (torch.randn(8, vocab, generator=gen) * 3).round()  # many ties
        x[0, :3] = float("-inf")
        x[1, ::7] = -0.0  # equal to 0.0: ties, kept in index order
        x[2, 1::2] = -0.0
        x[3] = torch.randn(vocab, generator=gen) * 1e-40  # subnormals
        x[4, :3] = float("inf")
        x[5] = torch.randn(vocab, generator=gen)
        values, order = _sort_descending(x)
        expected_values, expected_order = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(order, expected_order)
        assert torch.equal(values, expected_values)


def reference_probabilities(logits, p):  # type: ignore[no-untyped-def]
    """The single-row distribution as the sampler computed it before it was batched (with a
    stable sort, so that ties have one answer)."""
    import torch

    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    return scaled.softmax(-1)


def mixed_params(vocab: int) -> list[SamplingParams]:
    """Requests of every kind: top-p, top-k, both, neither, off values, greedy."""
    return [SamplingParams(temperature=0.8, top_p=0.9, seed=1),
            SamplingParams(temperature=0.8, top_k=50, seed=2),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3),
            SamplingParams(temperature=1.0, seed=4),
            SamplingParams(temperature=0.5, top_k=vocab, seed=5),  # top_k >= vocab: off
            SamplingParams(temperature=1.7, top_k=3, top_p=0.5, seed=6),
            SamplingParams(temperature=1.0, top_p=0.999, seed=7),
            SamplingParams(temperature=1.2, top_k=1, seed=8),
            SamplingParams(temperature=0.0)]


def test_probabilities_is_the_batched_distribution():
    import torch

    from tandem.services.engine.sampler import batch_probabilities, probabilities

    vocab = 4096
    gen = torch.Generator().manual_seed(3)
    params = [p for p in mixed_params(vocab) if not p.greedy]
    logits = torch.randn(len(params), vocab, generator=gen) * 4
    logits[:, :40] = logits[:, 40:80]  # ties, also at the top-k boundary
    batched = batch_probabilities(logits, params)
    for row, p in enumerate(params):
        alone = probabilities(logits[row], p)
        assert torch.equal(alone, batched[row]), p
        assert torch.equal(alone, reference_probabilities(logits[row], p)), p
        assert math.isclose(float(alone.sum()), 1.0, rel_tol=1e-5)
    kept = (batched > 0).sum(-1).tolist()
    assert kept[1] >= 50 and kept[7] == 1 and kept[3] == vocab  # top-k (ties stay), top_k=1
    # And rows that truncate or not, in any mixture, get the same distributions.
    for subset in ([0], [3], [3, 4], [0, 3, 1], list(range(len(params)))[::-1]):
        sub = batch_probabilities(logits[subset], [params[r] for r in subset])
        for i, r in enumerate(subset):
            assert torch.equal(sub[i], batched[r])


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    """A request's token at a position depends on its logits, params and position only: alone,
    or as row k of 32 with other requests (greedy and sampled, other seeds and params)."""
    import torch

    from tandem.services.engine.sampler import sample

    vocab = 4096
    gen = torch.Generator().manual_seed(5)
    others = mixed_params(vocab)
    targets = [SamplingParams(temperature=0.8, top_p=0.9, seed=123),
               SamplingParams(temperature=0.8, top_k=50, seed=123),
               SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=2**63 + 9)]
    not_greedy = 0
    for case, target in enumerate(targets):
        for position in (0, 1, 4095):
            logits = torch.randn(32, vocab, generator=gen) * 3
            k = (7 * case + position) % 32
            params = [SamplingParams(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                                     seed=None if o.seed is None else o.seed + 100 * i)
                      for i, o in enumerate(others * 4)][:32]
            params[k] = target
            positions = [(position + 3 * i) % 50 for i in range(32)]
            positions[k] = position
            batch = sample(logits, params, positions)
            alone = [sample(logits[i:i + 1], [p], [pos])[0]
                     for i, (p, pos) in enumerate(zip(params, positions, strict=True))]
            assert batch == alone, (case, position)
            assert sample(logits[k:k + 1], [target], [position]) == [batch[k]]
            greedy = logits.argmax(-1).tolist()
            assert all(batch[i] == greedy[i] for i, p in enumerate(params) if p.greedy)
            not_greedy += batch[k] != greedy[k]
    assert not_greedy > 0  # the target's draws are samples, not the argmax


def test_sample_is_the_race_on_the_distribution():
    """sample() of a row is argmax(probabilities / noise) with the position's noise."""
    import torch

    from tandem.services.engine.sampler import exponential_noise, probabilities, sample

    vocab = 1000
    gen = torch.Generator().manual_seed(9)
    params = [p for p in mixed_params(vocab) if not p.greedy]
    logits = torch.randn(len(params), vocab, generator=gen) * 2
    positions = list(range(3, 3 + len(params)))
    tokens = sample(logits, params, positions)
    for row, (p, position) in enumerate(zip(params, positions, strict=True)):
        race = probabilities(logits[row], p) / exponential_noise(p.seed, position, vocab)  # type: ignore[arg-type]
        assert tokens[row] == int(race.argmax())


def test_a_sampled_row_without_a_seed_is_refused():
    import pytest
    import torch

    from tandem.services.engine.sampler import sample

    with pytest.raises(ValueError, match="seed"):
        sample(torch.zeros(2, 5), [SamplingParams(temperature=0.0),
                                   SamplingParams(temperature=1.0)], [0, 0])
    assert sample(torch.zeros(0, 5), [], []) == []


def test_on_cuda_the_noise_and_draws_are_the_cpus():
    """Where a GPU is present: the noise is the CPU's bit for bit; a row's token is the same
    alone and in a batch; sample() syncs once (the tokens)."""
    import warnings

    import pytest
    import torch

    from tandem.services.engine.sampler import exponential_noise_rows, position_seed, sample

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    keys = torch.tensor([position_seed(s, i) for s in (1, 2**63 + 1) for i in (0, 5, 999)])
    vocab = 151936
    assert torch.equal(exponential_noise_rows(keys.cuda(), vocab).cpu(),
                       exponential_noise_rows(keys, vocab))
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(32, 49152, generator=gen) * 3).cuda()
    params = (mixed_params(49152) * 4)[:32]
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                             seed=None if p.seed is None else p.seed + i)
              for i, p in enumerate(params)]
    positions = list(range(32))
    batch = sample(logits, params, positions)
    assert batch == [sample(logits[i:i + 1], [p], [i])[0] for i, p in enumerate(params)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample(logits, params, positions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
