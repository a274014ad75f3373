"""Loading from Hugging Face directories: Llama-3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms,
Gemma 2 and Gemma 3, Qwen3-MoE's experts (tiny random checkpoints: ``tiny_models.py``), and the
built-in model re-saved as safetensors. Each is checked against transformers. The Gemma prompts
(150 tokens) outrun the sliding window and are prefilled in chunks of 48."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.services.engine.attention import resolve_backend
from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import load_model
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.engine.tiny_models import (
    GREEDY_LOGPROBS,
    assert_matches_transformers,
    random_prompt,
    save_tiny,
    tiny_qwen3_moe,
)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma2",
                                    "gemma3"])
def test_tiny_hf_models_match_transformers(family, tmp_path, loaded_model):
    hf = save_tiny(family, tmp_path, loaded_model)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.qk_norm == (family in ("qwen3", "gemma3"))
    assert loaded.config.gemma == family.startswith("gemma")
    assert loaded.config.attention_bias == (family == "qwen2")
    if family == "llama3":
        assert loaded.config.rope_scaling and loaded.config.rope_scaling["rope_type"] == "llama3"
    if family in ("mistral", "phi3"):  # the 150-token prompt outruns the 32-token window
        assert loaded.config.sliding_window == 32
        assert loaded.config.layer_types == ("sliding_attention",) * 2
    if family == "phi3":
        assert not any("qkv_proj" in n or "gate_up_proj" in n for n in loaded.weights)
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
    # auto picks torch wherever it would pick another backend for a Llama.
    features = loaded.config.attention_features
    assert resolve_backend("auto", "cuda", torch.bfloat16, features) == "torch"
    assert resolve_backend("auto", "cpu", torch.bfloat16, features) == "torch"


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_older_config_json_layout(family, tmp_path, loaded_model):
    """A config.json without layer_types and, for Gemma 3, with RoPE as rope_theta,
    rope_scaling and rope_local_base_freq (Hub files before transformers 5) reads as the
    current layout does."""
    save_tiny(family, tmp_path, loaded_model)
    current = load_model(tmp_path, progress=False).config
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    del hf["layer_types"], hf["rope_parameters"]
    if family == "gemma2":  # transformers' default: sliding and full layers alternate
        hf["rope_theta"] = 10000.0
    else:
        hf.update(rope_theta=50000.0, rope_local_base_freq=1000.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    path.write_text(json.dumps(hf))
    older = load_model(tmp_path, progress=False).config
    assert older == current
    assert older.layer_types[:2] == ("sliding_attention", "full_attention")


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
