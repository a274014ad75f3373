"""Tiny random-weight checkpoints of the model families we load from Hugging Face directories
(saved by transformers), and the check of our greedy output against a transformers pass.

The tiny Gemmas exercise what they add: a sliding window (32) shorter than the prompts the
tests use (150 tokens) on a mix of sliding and full layers, logit soft-capping small enough to
change the scores, a query scale other than head_dim's, RMSNorm weights that are not zero
(their ``1 + weight``), and Gemma 3's own RoPE base for its sliding layers beside linearly
scaled global ones."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.services.protocol.request import SamplingParams

VOCAB = 49152  # the built-in model's tokenizer, saved beside each tiny model
GREEDY_LOGPROBS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def tiny_model(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
                  initializer_range=0.2)
    gemma = dict(common, tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=24,
                 sliding_window=32, final_logit_softcapping=3.0)
    if family == "llama3":
        config = tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config, cls = tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM
    elif family == "mistral":  # Mistral 7B v0.1's shape: every layer slides
        config, cls = tf.MistralConfig(**common, sliding_window=32), tf.MistralForCausalLM
    elif family == "phi3":  # fused qkv_proj and gate_up_proj; every layer slides
        config, cls = tf.Phi3Config(**common, sliding_window=32), tf.Phi3ForCausalLM
    elif family == "gemma2":  # layers: sliding, full
        config = tf.Gemma2Config(**gemma, attn_logit_softcapping=4.0)
        cls = tf.Gemma2ForCausalLM
    else:
        config = tf.Gemma3TextConfig(**dict(gemma, num_hidden_layers=3), layer_types=[
            "sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
        cls = tf.Gemma3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    if family.startswith("gemma"):  # transformers starts Gemma's norm weights at 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    return model


def save_tiny(family: str, path: Path, loaded_model):  # type: ignore[no-untyped-def]
    """The tiny ``family`` model, saved in ``path`` with the built-in model's tokenizer."""
    hf = tiny_model(family)
    hf.save_pretrained(path)
    loaded_model.tokenizer.backend.save(str(path / "tokenizer.json"))
    return hf


def random_prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, VOCAB, (length,),
                                          generator=torch.Generator().manual_seed(seed))]


def assert_matches_transformers(hf, prompt: list[int], tokens: list[int],  # type: ignore[no-untyped-def]
                                logprobs: list[float]) -> None:
    """Greedy ``tokens`` after ``prompt`` and their ``logprobs`` against a teacher-forced
    transformers pass of ``hf``."""
    assert len(tokens) == len(logprobs) > 0
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens[:-1]])
        ref = hf(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
    ref_lp = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), ref_lp, atol=1e-4, rtol=0)
    # Each greedy token is transformers' argmax up to a genuine near-tie.
    assert bool((ref.max(-1).values - ref_lp < 1e-3).all())


def tiny_qwen3_moe(num_layers: int = 3, sparse_step: int = 1,
                   mlp_only_layers: Sequence[int] = (1,), norm_topk_prob: bool = True):  # type: ignore[no-untyped-def]
    """A random-weight transformers Qwen3-MoE of ``num_layers`` layers (8 experts, 2 a token;
    dense MLPs in ``mlp_only_layers`` and off ``sparse_step``), in eval mode, float32."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only_layers),
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
        initializer_range=0.2)
    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(config).eval()
