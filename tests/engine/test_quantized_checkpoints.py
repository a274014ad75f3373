"""Quantized Hugging Face checkpoints: FP8 weights load as their scales say (block-wise, per
tensor, per row) and the engine then matches transformers on those dequantized weights; every
other quantization method, and FP8 tensors that do not say how to read them, are refused by
name instead of loading packed integers as weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.services.engine.model_loader import ModelLoadError, load_model
from tests.engine.test_model_families import assert_greedy_matches_transformers
from tests.engine.tiny_models import tiny_model

BLOCK = 16  # the tiny models' dimensions (64, 128) are multiples of it
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """(FP8 weight, its scale as the checkpoint stores it, the dequantized weight)."""
    rows, cols = weight.shape
    if layout == "block":
        blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        scale = blocks.abs().amax((1, 3)) / FP8_MAX
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    elif layout == "row":
        scale = weight.abs().amax(1, keepdim=True) / FP8_MAX
        full = scale
    else:
        scale = weight.abs().amax() / FP8_MAX
        full = scale
    quantized = (weight / full).to(torch.float8_e4m3fn)
    return quantized, scale, quantized.float() * full


def _fp8_checkpoint(hf, directory: Path, layout: str, tokenizer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """``hf`` saved as an FP8 checkpoint in ``directory``; returns the dequantized weights
    (and loads them into ``hf``, the reference)."""
    hf.save_pretrained(directory)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    state = load_file(str(directory / "model.safetensors"))
    dequantized = {}
    for name in list(state):
        if not name.endswith(".weight") or name.split(".")[-2] not in PROJECTIONS:
            continue
        fp8, scale, dequantized[name] = _quantize(state[name].float(), layout)
        state[name] = fp8
        suffix = "weight_scale_inv" if layout == "block" else "weight_scale"
        state[name.removesuffix("weight") + suffix] = scale
        state[name.removesuffix("weight") + "input_scale"] = torch.ones(())  # dropped
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if layout == "block":
        config["quantization_config"]["weight_block_size"] = [BLOCK, BLOCK]
    (directory / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(dequantized, strict=False)
    return dequantized


@pytest.mark.parametrize("layout", ["block", "row", "tensor"])
def test_fp8_checkpoints_load_dequantized_and_match_transformers(layout, tmp_path,  # type: ignore[no-untyped-def]
                                                                 loaded_model):
    hf = tiny_model("llama3")
    dequantized = _fp8_checkpoint(hf, tmp_path, layout, loaded_model.tokenizer)
    loaded = load_model(tmp_path, progress=False)
    for name, expected in dequantized.items():
        assert torch.equal(loaded.weights[name], expected), name
    assert not any(n.endswith(("_scale", "_scale_inv")) for n in loaded.weights)
    assert_greedy_matches_transformers(hf, loaded, prompt_len=40, max_tokens=8, seed=2)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "compressed-tensors",
                                    "something-new"])
def test_other_quantization_methods_are_refused_by_name(method, tmp_path, loaded_model):  # type: ignore[no-untyped-def]
    hf = tiny_model("qwen2")
    hf.save_pretrained(tmp_path)
    loaded_model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"quantization method '{method}'"):
        load_model(tmp_path, progress=False)


def test_fp8_tensors_that_do_not_say_how_to_read_them_are_refused(tmp_path, loaded_model):  # type: ignore[no-untyped-def]
    hf = tiny_model("qwen2")
    _fp8_checkpoint(hf, tmp_path, "row", loaded_model.tokenizer)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_scale"
    scale = state.pop(name)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj.weight is torch.float8_e4m3fn without"):
        load_model(tmp_path, progress=False)
    # A scale of a shape no layout has.
    state[name] = scale[:5]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fits no fp8 layout"):
        load_model(tmp_path, progress=False)
    # FP8 tensors in a checkpoint whose config declares no quantization.
    state[name] = scale
    save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="declares no fp8 quantization_config"):
        load_model(tmp_path, progress=False)
