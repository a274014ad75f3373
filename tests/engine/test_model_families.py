"""Loading from Hugging Face directories: Llama-3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms,
Qwen3-MoE's experts, and the built-in model re-saved as safetensors. Each is checked against
transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.engine.helpers import assert_matches_teacher_forced, tiny_qwen3_moe


def tiny_model(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
                  initializer_range=0.2)
    if family == "llama3":
        config = tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    else:
        config, cls = tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_tiny_hf_models_match_transformers(family, tmp_path, loaded_model):
    hf = tiny_model(family)
    hf.save_pretrained(tmp_path)
    loaded_model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.qk_norm == (family == "qwen3")
    assert loaded.config.attention_bias == (family == "qwen2")
    if family == "llama3":
        assert loaded.config.rope_scaling and loaded.config.rope_scaling["rope_type"] == "llama3"
    # Positions past 64 exercise the Llama-3 long-context frequencies.
    assert_greedy_matches_transformers(hf, loaded, prompt_len=150, max_tokens=12, seed=1)


def assert_greedy_matches_transformers(hf, loaded, prompt_len: int, max_tokens: int,  # type: ignore[no-untyped-def]
                                       seed: int) -> None:
    """Our engine's greedy tokens and logprobs on ``loaded`` against a teacher-forced
    transformers pass of ``hf`` over the same tokens (a random prompt)."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=48), loaded)
    prompt = [int(t) for t in torch.randint(3, 49152, (prompt_len,),
                                             generator=torch.Generator().manual_seed(seed))]
    engine.add_request(GenerationRequest("r", prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)))
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs]
    assert_matches_teacher_forced(hf, prompt, tokens, logprobs)


@pytest.mark.parametrize(("layers", "step", "dense", "norm", "sparse"),
                         [(3, 1, (1,), True, (0, 2)), (4, 2, (), False, (1, 3))],
                         ids=["mlp_only_layers-norm_topk", "sparse_step_2"])
def test_tiny_qwen3_moe_matches_transformers(layers, step, dense, norm, sparse, tmp_path,
                                             loaded_model):
    hf = tiny_qwen3_moe(layers, step, dense, norm)
    hf.save_pretrained(tmp_path)
    loaded_model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(tmp_path, progress=False)
    c = loaded.config
    assert (c.moe_layers, c.num_experts, c.num_experts_per_tok) == (sparse, 8, 2)
    assert c.norm_topk_prob == norm and c.qk_norm
    # Stacked at load time: one [experts, ...] tensor per layer, no per-expert tensors left.
    assert tuple(loaded.weights[f"model.layers.{sparse[0]}.mlp.experts.gate_up_proj"].shape) \
        == (8, 64, 64)
    assert not any(".experts.0." in name for name in loaded.weights)
    # Chunked prefill (48 tokens a step) then decoding, greedy logprobs within 1e-4.
    assert_greedy_matches_transformers(hf, loaded, prompt_len=150, max_tokens=12, seed=1)
    # A batch (its tokens routed together) gives each request what it gets alone.
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64), loaded)
    prompts = [[int(t) for t in torch.randint(3, 49152, (n,),
                                              generator=torch.Generator().manual_seed(n))]
               for n in (5, 40, 23)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, greedy) == [engine.generate([p], greedy)[0]
                                                for p in prompts]


def test_builtin_model_resaved_as_hf_directory(tmp_path, hf_model, loaded_model, prompts,
                                               references):
    # transformers will not save a GGUF-loaded model, so write the directory by hand.
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded_model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.num_layers == 30 and loaded.config.tie_word_embeddings
    for name, tensor in loaded_model.weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    engine = LLMEngine(EngineConfig(num_kv_blocks=256), loaded)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts[:3], greedy) == [r.tokens for r in references[:3]]
