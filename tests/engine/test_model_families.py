"""Loading from Hugging Face directories: Llama-3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms,
Gemma 2 and Gemma 3, and the built-in model re-saved as safetensors. Each is checked against
transformers.

The tiny Gemmas exercise what they add: a sliding window (32) shorter than the prompt (150
tokens, prefilled in chunks of 48) on a mix of sliding and full layers, logit soft-capping
small enough to change the scores, a query scale other than head_dim's, RMSNorm weights that
are not zero (their ``1 + weight``), and Gemma 3's own RoPE base for its sliding layers beside
linearly scaled global ones."""

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


def save_tiny(family: str, path, loaded_model):  # type: ignore[no-untyped-def]
    """The tiny ``family`` model, saved in ``path`` with the built-in model's tokenizer."""
    hf = tiny_model(family)
    hf.save_pretrained(path)
    loaded_model.tokenizer.backend.save(str(path / "tokenizer.json"))
    return hf


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_tiny_hf_models_match_transformers(family, tmp_path, loaded_model):
    hf = save_tiny(family, tmp_path, loaded_model)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.qk_norm == (family in ("qwen3", "gemma3"))
    assert loaded.config.gemma == family.startswith("gemma")
    assert loaded.config.attention_bias == (family == "qwen2")
    if family == "llama3":
        assert loaded.config.rope_scaling and loaded.config.rope_scaling["rope_type"] == "llama3"
    if family == "gemma2":
        assert loaded.config.layer_types == ("sliding_attention", "full_attention")
        assert loaded.config.attn_logit_softcapping == 4.0
    if family == "gemma3":
        assert loaded.config.rope_local_theta == 1000.0 and loaded.config.rope_theta == 50000.0
        assert loaded.config.rope_scaling == {"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 50000.0}
    # Positions past 64 exercise the Llama-3 long-context frequencies.
    assert_greedy_matches_transformers(hf, loaded, prompt_len=150, max_tokens=12, seed=1)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_batch_matches_transformers(family, tmp_path, loaded_model):
    """Requests decoding together (a batch mask, cut to each one's window on sliding layers)
    beside prefill chunks, each against transformers."""
    hf = save_tiny(family, tmp_path, loaded_model)
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=48),
                       load_model(tmp_path, progress=False))
    assert engine.attention_backend == "torch"
    prompts = [random_prompt(n, seed) for seed, n in enumerate((150, 70, 20, 41))]
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", prompt, GREEDY_LOGPROBS))
    got: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(4)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.new_logprobs)
    for i, prompt in enumerate(prompts):
        assert_matches_transformers(hf, prompt, *got[f"r{i}"])


@pytest.mark.parametrize("backend", ["cpu", "triton", "flash_attn"])
def test_gemma_refuses_backends_without_its_attention(backend, tmp_path, loaded_model):
    save_tiny("gemma2", tmp_path, loaded_model)
    loaded = load_model(tmp_path, progress=False)
    dtype = "float32" if backend == "triton" else "bfloat16"
    blocks = 256 if backend == "flash_attn" else 16
    with pytest.raises(ValueError, match=f"attention_backend {backend} does not implement "
                                         f".*attention logit soft-capping.*sliding-window"):
        LLMEngine(EngineConfig(num_kv_blocks=64, attention_backend=backend, dtype=dtype,
                               block_size=blocks), loaded)


GREEDY_LOGPROBS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def random_prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, 49152, (length,),
                                          generator=torch.Generator().manual_seed(seed))]


def assert_greedy_matches_transformers(hf, loaded, prompt_len: int, max_tokens: int,  # type: ignore[no-untyped-def]
                                       seed: int) -> None:
    """Our engine's greedy tokens and logprobs on ``loaded`` against a teacher-forced
    transformers pass of ``hf`` over the same tokens (a random prompt)."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=48), loaded)
    prompt = random_prompt(prompt_len, seed)
    engine.add_request(GenerationRequest("r", prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)))
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs]
    assert_matches_transformers(hf, prompt, tokens, logprobs)


def assert_matches_transformers(hf, prompt: list[int], tokens: list[int],  # type: ignore[no-untyped-def]
                                logprobs: list[float]) -> None:
    """Greedy ``tokens`` after ``prompt`` and their ``logprobs`` against a teacher-forced
    transformers pass of ``hf``."""
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
