"""Qwen3-MoE's sparse MLP (engine/moe.py) against transformers' block, its experts run once
per step on their token groups, bfloat16 with the torch and cpu attention backends, and what a
mixture-of-experts model refuses: tensor parallelism, other MoE architectures, a checkpoint
missing an expert. The whole model against
transformers is tests/engine/test_model_families.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.services.engine import cpu_kernels
from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, ModelLoadError, load_model
from tandem.services.engine.moe import MoeMlp
from tandem.services.protocol.request import SamplingParams
from tests.engine.tiny_models import tiny_qwen3_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, loaded_model: LoadedModel) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("qwen3-moe")
    tiny_qwen3_moe().save_pretrained(path)
    loaded_model.tokenizer.backend.save(str(path / "tokenizer.json"))
    return path


def block_of(hf, layer: int, norm: bool) -> MoeMlp:  # type: ignore[no-untyped-def]
    mlp = hf.model.layers[layer].mlp
    return MoeMlp(mlp.gate.weight.detach(), mlp.experts.gate_up_proj.detach(),
                  mlp.experts.down_proj.detach(), top_k=2, norm_topk_prob=norm)


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
def test_block_matches_transformers_and_runs_each_expert_once(norm, monkeypatch):
    hf = tiny_qwen3_moe(norm_topk_prob=norm)
    block = block_of(hf, 0, norm)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf.model.layers[0].mlp(x.unsqueeze(0))[0]
    calls: list[int] = []
    run = MoeMlp._expert

    def counted(self: MoeMlp, expert: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return run(self, expert, rows)

    monkeypatch.setattr(MoeMlp, "_expert", counted)
    with torch.inference_mode():
        got = block(x)
        _, experts = block.route(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # Grouped: one call per expert with tokens, on all of its tokens.
    groups = [n for n in torch.bincount(experts.flatten()).tolist() if n]
    assert sorted(calls) == sorted(groups) and len(calls) > 1 and sum(calls) == 37 * 2


def test_no_tokens_no_experts():
    block = block_of(tiny_qwen3_moe(), 0, True)
    assert block(torch.zeros(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_greedy_stays_near_float32(backend, moe_dir):
    """The experts in bfloat16, beside our cpu backend's kernels (norms, rotary, attention)
    too where this CPU runs them: the greedy tokens of 8 random prompts against transformers'
    in float32 (bfloat16 tips near-ties and routing: measured with torch, all 8 agree over 3
    tokens, 6 over 4)."""
    if backend == "cpu" and (reason := cpu_kernels.unavailable_reason()) is not None:
        pytest.skip(f"cpu decode kernel: {reason}")
    loaded = load_model(moe_dir, dtype="bfloat16", progress=False)
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, dtype="bfloat16",
                                    attention_backend=backend), loaded)
    model = engine.runner.model
    assert model.attention.name == backend and model.cpu_layers is None
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    prompts = [[int(t) for t in torch.randint(3, 49152, (60,),
                                              generator=torch.Generator().manual_seed(seed))]
               for seed in range(8)]
    got = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                                                  ignore_eos=True))
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        ref = tiny_qwen3_moe().generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=4, do_sample=False)[:, 60:].tolist()
    agree = sum(g[:2] == r[:2] for g, r in zip(got, ref, strict=True))
    assert agree >= 6, f"only {agree}/8 outputs agree with float32 over 2 tokens"


def test_tensor_parallel_is_refused_at_start_up(moe_dir):
    loaded = load_model(moe_dir, progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not support "
                                         "mixture-of-experts"):
        LLMEngine(EngineConfig(num_kv_blocks=16, tensor_parallel_size=2), loaded)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_other_moe_architectures_are_refused_by_name(arch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    with pytest.raises(ModelLoadError, match=f"unsupported architectures \\['{arch}'\\]"):
        load_model(tmp_path, progress=False)


def test_a_missing_expert_is_refused(moe_dir, tmp_path):
    for f in moe_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing 1 expert weight tensors, e\.g\. "
                                             r"\['model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        load_model(tmp_path, progress=False)
