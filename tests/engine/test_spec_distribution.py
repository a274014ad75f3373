"""Sampling draws the right distribution, and speculation emits exactly the plain tokens.

A tiny randomly initialised Llama (vocab 10) is sampled thousands of times, each request with
its own seed. The sampler's exponential race (engine/sampler.py, with its counter-based hash
noise) must draw each position's token from the model's distribution: a two-sample chi-square
test against ``torch.multinomial`` on the same probabilities must pass, for the noise alone and
for the batched ``sample`` (with top-k and top-p too), and a deliberately broken race
(multiplying by the noise instead of dividing, which favours unlikely tokens) must fail it.
With a draft model (the same Llama with noise added, so drafts are often wrong), every
request's tokens must equal its tokens without speculation, since verification accepts a
draft only where it equals the target's own draw.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tandem.services.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.engine.sampler import exponential_noise, probabilities, sample
from tandem.services.protocol.request import SamplingParams

VOCAB = 10
SAMPLES = 3000
PROMPT = [1, 2, 3, 4, 5]
CRITICAL_P = 1e-3


def tiny_llama(seed: int, scale: float) -> LoadedModel:
    config = ModelConfig(model_id=f"tiny-{seed}", vocab_size=VOCAB, hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         eos_token_ids=(0,))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    h, f, qd, kvd = 32, 64, 4 * 8, 2 * 8
    weights = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": torch.ones(h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(qd, h), p + "self_attn.k_proj.weight": rand(kvd, h),
            p + "self_attn.v_proj.weight": rand(kvd, h), p + "self_attn.o_proj.weight": rand(h, qd),
            p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
        }
    return LoadedModel(config, weights, tokenizer=None, source=Path(f"tiny-{seed}"))  # type: ignore[arg-type]


def perturbed(model: LoadedModel, seed: int, amount: float) -> LoadedModel:
    """The draft: the target's weights plus noise, so it is right often but not always."""
    gen = torch.Generator().manual_seed(seed)
    weights = {name: w + amount * torch.randn(w.shape, generator=gen)
               for name, w in model.weights.items()}
    return LoadedModel(model.config, weights, model.tokenizer, Path(f"{model.source}-draft"))


def engine(spec: bool) -> LLMEngine:
    method = "draft" if spec else "none"
    config = EngineConfig(num_kv_blocks=4096, max_num_seqs=512, max_num_batched_tokens=4096,
                          max_waiting=SAMPLES,
                          speculative=SpeculativeConfig(method=method, k=3, adaptive=False))
    target = tiny_llama(0, 0.5)
    return LLMEngine(config, target, draft=perturbed(target, 1, 0.1) if spec else None)


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i)
            for i in range(n)]


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the two-sample chi-square test that ``a`` and ``b`` (token ids) come from
    the same distribution."""
    counts = torch.stack([torch.bincount(a, minlength=VOCAB),
                          torch.bincount(b, minlength=VOCAB)]).double()
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def test_the_exponential_race_draws_from_the_distribution():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, -1)
    race = torch.tensor([int((probs / exponential_noise(seed, 0, VOCAB)).argmax())
                         for seed in range(SAMPLES)])
    broken = torch.tensor([int((probs * exponential_noise(seed, 0, VOCAB)).argmax())
                           for seed in range(SAMPLES)])
    reference = torch.multinomial(probs, SAMPLES, replacement=True, generator=gen)
    p_ok = chi_square_p(race, reference)
    assert p_ok > CRITICAL_P, f"the race rejected (p={p_ok:.2g})"
    p_broken = chi_square_p(broken, reference)
    assert p_broken < CRITICAL_P, f"the broken race went unnoticed (p={p_broken:.2g})"


def test_the_batched_sampler_draws_from_the_distribution():
    """``sample`` itself, one batch of SAMPLES rows (one seed each), draws from
    ``probabilities``: plain, top-k and top-p."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(VOCAB, generator=gen) * 1.5
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6),
                   SamplingParams(temperature=1.3, top_p=0.8)):
        rows = [replace(params, seed=seed) for seed in range(SAMPLES)]
        tokens = torch.tensor(sample(logits.expand(SAMPLES, VOCAB), rows, [5] * SAMPLES))
        probs = probabilities(logits, params)
        assert bool((probs[tokens] > 0).all()), "a truncated token was drawn"
        reference = torch.multinomial(probs, SAMPLES, replacement=True, generator=gen)
        p_ok = chi_square_p(tokens, reference)
        assert p_ok > CRITICAL_P, f"{params}: the batched race rejected (p={p_ok:.2g})"


def test_positions_draw_independently():
    """Each position's noise is its own: the tokens at positions 0 and 1 of one seed are not
    the same draw twice."""
    same = sum(bool(torch.equal(exponential_noise(s, 0, VOCAB), exponential_noise(s, 1, VOCAB)))
               for s in range(100))
    assert same == 0


def test_speculative_sampling_emits_the_plain_tokens():
    plain = engine(spec=False).generate([PROMPT] * SAMPLES, seeded(SAMPLES))
    spec_engine = engine(spec=True)
    speculative = spec_engine.generate([PROMPT] * SAMPLES, seeded(SAMPLES))
    stats = spec_engine.stats
    assert stats.spec_draft_tokens >= SAMPLES * 2  # k is 2 on the first speculative step
    # Drafts are often rejected, often accepted: both outcomes of verification are exercised.
    assert 0.2 < stats.spec_accepted_tokens / stats.spec_draft_tokens < 0.95
    assert speculative == plain
    # ... and they are samples, not one fixed answer.
    assert len({tuple(tokens) for tokens in plain}) > 100


def test_chi_square_p_value_sanity():
    gen = torch.Generator().manual_seed(0)
    same = [torch.randint(0, VOCAB, (SAMPLES,), generator=gen) for _ in range(2)]
    assert chi_square_p(*same) > 0.01
    skewed = same[1].clone()
    skewed[: SAMPLES // 10] = 0
    assert chi_square_p(same[0], skewed) < 1e-6
