"""Rejection sampling keeps the target's output distribution (issue: speculative decoding).

A tiny randomly initialised Llama (vocab 10) is sampled thousands of times with and without a
draft model (the same Llama with noise added, so drafts are often wrong). A two-sample
chi-square test on the tokens that speculation produced must pass at a fixed seed budget; a
deliberately broken acceptance rule (resampling from the target instead of the residual after
a rejection, a classic mistake) must fail the same test. It once caught the draft reusing the
request's seed, which correlated its draws with the target's acceptance draws.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from services.engine.llm_engine import LLMEngine
from services.engine.model_loader import LoadedModel
from services.engine.sampling_params import SamplingParams

VOCAB = 10
SAMPLES = 3000
PROMPT = [1, 2, 3, 4, 5]
SPEC_POSITIONS = (1, 2, 3)  # output tokens 2-4: drafted (2, 3) or after a rejection (4)
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


def sample_outputs(spec: bool, acceptance_rule=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[SAMPLES, 4] output tokens, each request with its own seed."""
    method = "draft" if spec else "none"
    config = EngineConfig(num_kv_blocks=4096, max_num_seqs=512, max_num_batched_tokens=4096,
                          max_waiting=SAMPLES,
                          speculative=SpeculativeConfig(method=method, k=3, adaptive=False))
    target = tiny_llama(0, 0.5)
    engine = LLMEngine(config, target, draft=perturbed(target, 1, 0.1) if spec else None)
    if acceptance_rule is not None:
        engine.sampler.acceptance_rule = acceptance_rule
    params = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(SAMPLES)]
    outputs = torch.tensor(engine.generate([PROMPT] * SAMPLES, params))
    if spec:
        stats = engine.stats
        assert stats.spec_draft_tokens >= SAMPLES * 2  # k is 2 on the first speculative step
        # Drafts are often rejected, often accepted: both branches of the rule are exercised.
        assert 0.2 < stats.spec_accepted_tokens / stats.spec_draft_tokens < 0.9
    return outputs


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


def resample_from_target(target_probs, draft_tokens, draft_probs, generator):  # type: ignore[no-untyped-def]
    """Broken: after a rejection, draws from p instead of the residual max(0, p - q)."""
    emitted = []
    for i, draft in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand((), generator=generator)) * float(q[draft]) < float(p[draft]):
            emitted.append(draft)
            continue
        emitted.append(int(torch.multinomial(p, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return emitted


def test_speculative_sampling_preserves_the_distribution():
    plain = sample_outputs(spec=False)
    speculative = sample_outputs(spec=True)
    broken = sample_outputs(spec=True, acceptance_rule=resample_from_target)
    for position in SPEC_POSITIONS:
        p_ok = chi_square_p(plain[:, position], speculative[:, position])
        assert p_ok > CRITICAL_P, f"token {position}: correct rule rejected (p={p_ok:.2g})"
    worst = min(chi_square_p(plain[:, pos], broken[:, pos]) for pos in SPEC_POSITIONS)
    assert worst < CRITICAL_P, f"the broken rule went unnoticed (p={worst:.2g})"


def test_chi_square_p_value_sanity():
    gen = torch.Generator().manual_seed(0)
    same = [torch.randint(0, VOCAB, (SAMPLES,), generator=gen) for _ in range(2)]
    assert chi_square_p(*same) > 0.01
    skewed = same[1].clone()
    skewed[: SAMPLES // 10] = 0
    assert chi_square_p(same[0], skewed) < 1e-6
