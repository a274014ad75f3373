"""Loading from Hugging Face directories: Llama-3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms,
and the built-in model re-saved as safetensors. Each is checked against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams


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
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens[:-1]])
        ref = hf(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
    ref_lp = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), ref_lp, atol=1e-4, rtol=0)
    # Each greedy token is transformers' argmax up to a genuine near-tie.
    assert bool((ref.max(-1).values - ref_lp < 1e-3).all())


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
