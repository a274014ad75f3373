"""Load a Llama-family model's config, weights and tokenizer from a GGUF file or a HF directory.

Weights come out under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) as torch
tensors in the requested dtype; the model module fuses what it wants from there. The tokenizer,
``model_id`` and context length come from ``tokenizer_loader``, which reads them without weights.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tandem.services.engine.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    WEIGHT_FORMATS,
    ModelConfig,
)
from tandem.services.engine.int4_linear import Q4Weight
from tandem.services.engine.moe import DOWN, GATE_UP, ROUTER
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.engine.tokenizer_loader import (
    GGUFTensorInfo,
    ModelLoadError,
    builtin_model_path,
    metadata_from_gguf,
    metadata_from_hf_dir,
    model_source,
    read_gguf,
    read_hf_config,
)

__all__ = ["LoadedModel", "ModelLoadError", "builtin_model_path", "load_model"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    # weight_format int4: the GGUF's Q4_1 weights as they are (``weights`` holds the same
    # values in ``dtype``), by Hugging Face name
    quantized: dict[str, Q4Weight] = dataclasses.field(default_factory=dict)
    # ... and its lm_head (or tied embedding) when Q8_0: two int4 terms, ``bfloat16(d) * q``
    quantized_head: tuple[Q4Weight, ...] = ()


def load_model(path: str | Path | None = None, dtype: str = "float32", progress: bool = True,
               weight_format: str = "dense") -> LoadedModel:
    """Load from a .gguf file or a Hugging Face directory; None loads the built-in model.
    ``weight_format`` int4 keeps a GGUF's Q4_1 weights 4-bit (bfloat16 only)."""
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    if weight_format not in WEIGHT_FORMATS:
        raise ModelLoadError(f"unsupported weight_format {weight_format!r}; use one of "
                             f"{', '.join(WEIGHT_FORMATS)}")
    int4 = weight_format == "int4"
    if int4 and dtype != "bfloat16":
        raise ModelLoadError(f"weight_format int4 needs dtype bfloat16, got {dtype!r}")
    source = model_source(path)
    if source.is_dir():
        if int4:
            raise ModelLoadError(f"weight_format int4 needs a GGUF file with Q4_1 weights; "
                                 f"{source} is a Hugging Face (safetensors) directory")
        return _load_hf_dir(source, _DTYPES[dtype], progress)
    return _load_gguf(source, _DTYPES[dtype], progress, int4)


# ---------------------------------------------------------------------------------------------
# GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _gguf_name_to_hf(name: str) -> str | None:
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _GGUF_LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    mapped = _GGUF_TOP_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{kind}"


def _undo_gguf_qk_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves; restore HF's layout."""
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(
        weights.shape
    )


@dataclass(frozen=True)
class _GGUFTensor:
    """One tensor of a GGUF file: its data a read-only numpy view of the mapped file, typed
    and shaped as ``gguf.GGUFReader`` gives it (quantized types: rows of bytes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order
    data: np.ndarray


def _gguf_tensors(path: Path, infos: list[GGUFTensorInfo]) -> list[_GGUFTensor]:
    import gguf

    kinds = gguf.GGMLQuantizationType
    plain = {kinds.F32: np.float32, kinds.F16: np.float16, kinds.F64: np.float64,
             kinds.I8: np.int8, kinds.I16: np.int16, kinds.I32: np.int32, kinds.I64: np.int64}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for info in infos:
        try:
            kind = kinds(info.ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{path}: tensor {info.name} has an unknown type "
                                 f"{info.ggml_type}") from exc
        dims = tuple(reversed(info.shape))
        size = math.prod(info.shape) * type_size // block
        if info.offset + size > len(raw):
            raise ModelLoadError(f"not a valid GGUF file: {path} (tensor {info.name} runs "
                                 f"past the end)")
        data = raw[info.offset:info.offset + size]
        if kind in plain:
            data = data.view(plain[kind]).reshape(dims)
        else:
            data = data.reshape(gguf.quants.quant_shape_to_byte_shape(dims, kind))
        tensors.append(_GGUFTensor(info.name, kind, info.shape, data))
    return tensors


def _load_gguf(path: Path, dtype: torch.dtype, progress: bool, int4: bool = False
               ) -> LoadedModel:
    import gguf

    meta, infos = read_gguf(path)
    field = meta.get
    arch = str(field("general.architecture", ""))
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; expected {_GGUF_ARCHS}")
    num_heads = int(field(f"{arch}.attention.head_count"))  # type: ignore[arg-type]
    num_kv_heads = int(field(f"{arch}.attention.head_count_kv", num_heads))  # type: ignore[arg-type]
    hidden = int(field(f"{arch}.embedding_length"))  # type: ignore[arg-type]
    metadata = metadata_from_gguf(path, meta)

    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, Q4Weight] = {}
    q8_0: dict[str, tuple[Q4Weight, Q4Weight]] = {}  # int4: the head's candidates
    for tensor in tqdm(_gguf_tensors(path, infos), desc=f"loading {path.name}",
                       disable=not progress, unit="tensor", leave=False):
        hf_name = _gguf_name_to_hf(tensor.name)
        if hf_name is None:
            continue
        if int4 and tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            q4 = _q4_weight(tensor, hf_name, num_heads, num_kv_heads)
            quantized[hf_name] = q4
            weights[hf_name] = q4.dequantize().to(dtype)
            continue
        if (int4 and tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
                and hf_name in _HEAD_NAMES):
            q8_0[hf_name] = Q4Weight.pair_from_q8_0(
                tensor.data, tuple(int(d) for d in reversed(tensor.shape)))  # type: ignore[arg-type]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot dequantize {tensor.name}: {exc}") from exc
        array = np.array(array, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(tensor.shape))
        )
        if ".q_proj." in hf_name:
            array = _undo_gguf_qk_permute(array, num_heads)
        elif ".k_proj." in hf_name:
            array = _undo_gguf_qk_permute(array, num_kv_heads)
        weights[hf_name] = torch.from_numpy(array).to(dtype)

    if int4 and not quantized:
        raise ModelLoadError(f"weight_format int4 needs Q4_1 weights; {path} has none "
                             f"(use weight_format dense)")
    rope_dim = field(f"{arch}.rope.dimension_count")
    head_dim = int(field(f"{arch}.attention.key_length", rope_dim or hidden // num_heads))  # type: ignore[arg-type]
    tokenizer = metadata.tokenizer
    config = ModelConfig(
        model_id=metadata.model_id,
        vocab_size=len(field("tokenizer.ggml.tokens")),  # type: ignore[arg-type]
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),  # type: ignore[arg-type]
        num_layers=int(field(f"{arch}.block_count")),  # type: ignore[arg-type]
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),  # type: ignore[arg-type]
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        max_position_embeddings=metadata.max_position_embeddings,
        tie_word_embeddings="lm_head.weight" not in weights,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        rope_scaling=_gguf_rope_scaling(field, arch),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in weights,
    )
    _check_weights(config, weights, path)
    head = q8_0.get("lm_head.weight" if not config.tie_word_embeddings
                    else "model.embed_tokens.weight", ())
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=path,
                       quantized=quantized, quantized_head=head)


# The tensors that can be the output projection: its own, or the tied token embedding.
_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def _q4_weight(tensor, hf_name: str, num_heads: int, num_kv_heads: int  # type: ignore[no-untyped-def]
               ) -> Q4Weight:
    """A Q4_1 GGUF tensor as it is, its rows in Hugging Face's order."""
    out, inp = (int(d) for d in reversed(tensor.shape))
    q4 = Q4Weight.from_q4_1(tensor.data, (out, inp))
    for proj, heads in ((".q_proj.", num_heads), (".k_proj.", num_kv_heads)):
        if proj in hf_name:
            q4 = q4.rows(_undo_gguf_qk_permute(np.arange(out), heads))
    return q4


def _gguf_rope_scaling(field, arch: str) -> dict[str, object] | None:  # type: ignore[no-untyped-def]
    kind = field(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": str(kind), "factor": float(field(f"{arch}.rope.scaling.factor", 1.0))}


# ---------------------------------------------------------------------------------------------
# Hugging Face directory

_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
             "Phi3ForCausalLM")
# Families whose config.json's sliding_window (when set) applies to every layer.
_WINDOWED_ARCHS = ("MistralForCausalLM", "Phi3ForCausalLM")
_GEMMA_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _load_hf_dir(path: Path, dtype: torch.dtype, progress: bool) -> LoadedModel:
    from safetensors.torch import load_file

    hf = read_hf_config(path)
    archs = hf.get("architectures") or []
    if not any(a in _HF_ARCHS for a in archs):
        raise ModelLoadError(f"{path}: unsupported architectures {archs}; expected {_HF_ARCHS}")
    metadata = metadata_from_hf_dir(path, hf)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path}: no .safetensors weight files")

    fp8 = _fp8_scheme(hf, path)
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}  # FP8 weights and their scales, kept to the end
    for shard in tqdm(shards, desc=f"loading {path.name}", disable=not progress, leave=False):
        try:
            tensors = load_file(str(shard))
        except Exception as exc:
            raise ModelLoadError(f"{shard}: cannot read safetensors ({exc})") from exc
        for name, tensor in tensors.items():
            if tensor.dtype in _FP8 or name.endswith(_SCALES):
                quantized[name] = tensor
            else:
                weights[name] = tensor.to(dtype)
    weights |= {name: t.to(dtype) for name, t in _dequantize_fp8(quantized, fp8, path).items()}

    num_heads = int(hf["num_attention_heads"])
    if "Phi3ForCausalLM" in archs:
        _split_phi3(weights, hf, path)
    tie = bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in weights
    config = ModelConfig(
        model_id=metadata.model_id,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads", num_heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0))),
        max_position_embeddings=metadata.max_position_embeddings,
        tie_word_embeddings=tie,
        eos_token_ids=metadata.tokenizer.eos_token_ids,
        bos_token_id=metadata.tokenizer.bos_token_id,
        rope_scaling=_hf_rope_scaling(hf),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in weights,
        **(_qwen3_moe_fields(hf) if "Qwen3MoeForCausalLM" in archs else {}),
        **_window_fields(hf, int(hf["num_hidden_layers"]), archs),
    )
    if any(a in _GEMMA_ARCHS for a in archs):
        config = _gemma_config(config, hf, "Gemma3ForCausalLM" in archs, path)
    _stack_experts(config, weights, path)
    _check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, tokenizer=metadata.tokenizer, source=path)


def _window_fields(hf: dict[str, Any], num_layers: int, archs: list[str]) -> dict[str, Any]:
    """Sliding-window attention as transformers applies it: on the layers config.json's
    ``layer_types`` marks sliding; else Qwen2/3's ``use_sliding_window`` from layer
    ``max_window_layers`` on; else every layer of Mistral and Phi-3 when ``sliding_window``
    is set (Mistral 7B v0.1: 4096). {} when no layer slides."""
    window = hf.get("sliding_window")
    types = tuple(str(t) for t in hf.get("layer_types") or ())
    if not types and hf.get("use_sliding_window") and window:
        first = int(hf.get("max_window_layers", num_layers))
        types = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                      for i in range(num_layers))
    elif not types and window and any(a in _WINDOWED_ARCHS for a in archs):
        types = (SLIDING_ATTENTION,) * num_layers
    if SLIDING_ATTENTION not in types or not window:
        return {}
    return {"sliding_window": int(window), "layer_types": types}


def _split_phi3(weights: dict[str, torch.Tensor], hf: dict[str, Any], path: Path) -> None:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as the q/k/v and gate/up tensors the
    model fuses again its own way; a partial rotary embedding (Phi-4-mini) is refused."""
    rotary = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                   hf.get("partial_rotary_factor", 1.0))
    if float(rotary) != 1.0:
        raise ModelLoadError(f"{path}: partial_rotary_factor {rotary} (RoPE on part of each "
                             f"head) is not supported")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    kv = int(hf.get("num_key_value_heads", heads)) * head_dim
    for i in range(int(hf["num_hidden_layers"])):
        p = f"model.layers.{i}."
        if p + "self_attn.qkv_proj.weight" in weights:
            q, k, v = weights.pop(p + "self_attn.qkv_proj.weight").split(
                [heads * head_dim, kv, kv])
            weights |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v}
        if p + "mlp.gate_up_proj.weight" in weights:
            gate, up = weights.pop(p + "mlp.gate_up_proj.weight").chunk(2)
            weights |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}


def _gemma_config(config: ModelConfig, hf: dict[str, Any], gemma3: bool, path: Path
                  ) -> ModelConfig:
    """``config`` with Gemma 2's or Gemma 3's parts from its config.json, each key's default
    transformers' own (Gemma2Config, Gemma3TextConfig)."""
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{path}: hidden_activation {activation!r} is not supported for "
                             f"Gemma (gelu_pytorch_tanh is)")
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: use_bidirectional_attention (an embedding model) is not "
                             f"supported; Tandem runs causal decoders")
    global_rope, local_theta = _gemma_rope(hf, gemma3, path)
    return dataclasses.replace(
        config, gemma=True, hidden_act=activation,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        # Gemma 3's attention takes no soft-capping in transformers, whatever the config says.
        attn_logit_softcapping=None if gemma3 else _optional_float(hf, "attn_logit_softcapping",
                                                                   50.0),
        final_logit_softcapping=_optional_float(hf, "final_logit_softcapping",
                                                None if gemma3 else 30.0),
        sliding_window=int(hf.get("sliding_window") or 4096),
        layer_types=_gemma_layer_types(hf, config.num_layers, gemma3),
        rope_theta=float(global_rope.get("rope_theta", config.rope_theta)),
        rope_scaling=_hf_rope_scaling({"rope_parameters": global_rope}),
        rope_local_theta=local_theta)


def _optional_float(hf: dict[str, Any], key: str, default: float | None) -> float | None:
    value = hf.get(key, default)
    return None if value is None else float(value)


def _gemma_layer_types(hf: dict[str, Any], num_layers: int, gemma3: bool) -> tuple[str, ...]:
    """config.json's layer_types, or transformers' pattern without them: Gemma 2 alternates
    sliding and full layers, Gemma 3 has a full one every ``sliding_window_pattern`` (6)."""
    if hf.get("layer_types"):
        return tuple(str(t) for t in hf["layer_types"])
    every = int(hf.get("sliding_window_pattern", 6)) if gemma3 else 2
    return tuple(SLIDING_ATTENTION if (i + 1) % every else FULL_ATTENTION
                 for i in range(num_layers))


def _gemma_rope(hf: dict[str, Any], gemma3: bool, path: Path
                ) -> tuple[dict[str, Any], float | None]:
    """The full layers' RoPE parameters, and Gemma 3's sliding layers' base (None: Gemma 2,
    one RoPE for every layer). Gemma 3 keeps them per layer type in ``rope_parameters``
    (transformers 5), or as ``rope_theta`` and ``rope_scaling`` for the full layers and
    ``rope_local_base_freq`` for the sliding ones (older config.json files)."""
    params = hf.get("rope_parameters") or {}
    if not gemma3:
        return {"rope_theta": hf.get("rope_theta", params.get("rope_theta", 10000.0)),
                **params}, None
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full = dict(params.get(FULL_ATTENTION) or {})
        local = dict(params.get(SLIDING_ATTENTION) or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", 1e6)
    kind = local.get("rope_type") or local.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(f"{path}: RoPE type {kind!r} on the sliding layers is not "
                             f"supported (default is)")
    return full, float(local.get("rope_theta", 10000.0))


def _qwen3_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Qwen3-MoE config.json: a layer is sparse
    unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` (transformers'
    rule); transformers 5 writes ``num_experts`` as ``num_local_experts``."""
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)))
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(int(hf["num_hidden_layers"]))
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    return {"moe_layers": layers, "num_experts": experts,
            "num_experts_per_tok": int(hf.get("num_experts_per_tok", 0)),
            "moe_intermediate_size": int(hf.get("moe_intermediate_size", 0)),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _stack_experts(config: ModelConfig, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Each sparse layer's per-expert ``mlp.experts.E.{gate,up,down}_proj.weight`` (the
    checkpoints' layout) stacked in place into transformers' ``mlp.experts.gate_up_proj``
    [experts, 2 * intermediate, hidden] and ``mlp.experts.down_proj`` [experts, hidden,
    intermediate] (engine/moe.py), a layer at a time."""
    for i in config.moe_layers:
        p = f"model.layers.{i}.mlp.experts."
        names = [[f"{p}{e}.{part}_proj.weight" for part in ("gate", "up", "down")]
                 for e in range(config.num_experts)]
        missing = [n for expert in names for n in expert if n not in weights]
        if missing:
            raise ModelLoadError(f"{path}: missing {len(missing)} expert weight tensors, e.g. "
                                 f"{missing[:3]}")
        try:
            weights[p + "gate_up_proj"] = torch.stack(
                [torch.cat([weights.pop(gate), weights.pop(up)]) for gate, up, _ in names])
            weights[p + "down_proj"] = torch.stack([weights.pop(down) for _, _, down in names])
        except RuntimeError as exc:  # shapes that do not stack
            raise ModelLoadError(f"{path}: layer {i}'s experts differ in shape ({exc})") from exc


# quantization_config methods: fp8 is read (below); these are refused by name, never loaded
# as if their packed integers were weights.
_REFUSED_QUANTIZATION = ("gptq", "awq", "bitsandbytes", "compressed-tensors", "aqlm", "eetq",
                         "hqq", "marlin", "quanto", "torchao", "bitnet", "mxfp4", "vptq")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALES = (".weight_scale_inv", ".weight_scale", ".input_scale")


@dataclass(frozen=True)
class _Fp8Scheme:
    block: tuple[int, int] | None  # weight_block_size (rows, columns); None: per tensor/row


def _fp8_scheme(hf: dict[str, object], path: Path) -> _Fp8Scheme | None:
    """The checkpoint's FP8 weight scheme from ``quantization_config`` (None: unquantized);
    any other method is refused naming it."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    method = str(quant.get("quant_method", "?")) if isinstance(quant, dict) else "?"
    if method != "fp8":
        known = " (a known method Tandem does not run)" if method in _REFUSED_QUANTIZATION else ""
        raise ModelLoadError(f"{path}: quantization method {method!r}{known} is not supported; "
                             f"Tandem reads unquantized checkpoints and fp8 (per tensor, per "
                             f"row or block-wise weight scales)")
    assert isinstance(quant, dict)
    block = quant.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{path}: quantization_config weight_block_size {block!r} is not "
                             f"two positive integers")
    return _Fp8Scheme(tuple(block) if block is not None else None)  # type: ignore[arg-type]


def _dequantize_fp8(weights: dict[str, torch.Tensor], scheme: _Fp8Scheme | None,
                    path: Path) -> dict[str, torch.Tensor]:
    """FP8 weights times their scales, in float32: ``X.weight_scale_inv`` per block of
    ``weight_block_size`` (transformers' and DeepSeek's layout; multiplied, whatever the name),
    or ``X.weight_scale`` per tensor or per row (vLLM's fp8). Activation scales
    (``input_scale``) are dropped: the projections run in the model dtype. An FP8 tensor
    without a scale, or one in a checkpoint that declares no fp8 method, is refused."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(_SCALES):
            continue
        if tensor.dtype not in _FP8:
            out[name] = tensor
            continue
        base = name.removesuffix(".weight")
        if scheme is None:
            raise ModelLoadError(f"{path}: {name} is {tensor.dtype} but config.json declares "
                                 f"no fp8 quantization_config")
        scale = weights.get(base + ".weight_scale_inv", weights.get(base + ".weight_scale"))
        if scale is None:
            raise ModelLoadError(f"{path}: {name} is {tensor.dtype} without a weight_scale_inv "
                                 f"or weight_scale")
        out[name] = _scaled(tensor.float(), scale.float(), scheme, name, path)
    return out


def _scaled(weight: torch.Tensor, scale: torch.Tensor, scheme: _Fp8Scheme, name: str,
            path: Path) -> torch.Tensor:
    rows, cols = weight.shape
    if scale.numel() == 1:
        return weight * scale.reshape(())
    if scale.shape in ((rows,), (rows, 1)):
        return weight * scale.reshape(rows, 1)
    if scheme.block is not None:
        br, bc = scheme.block
        if scale.shape == (-(-rows // br), -(-cols // bc)):
            full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
            return weight * full
    raise ModelLoadError(f"{path}: {name} {tuple(weight.shape)} has a scale of shape "
                         f"{tuple(scale.shape)}, which fits no fp8 layout (per tensor, per row, "
                         f"or blocks of {scheme.block})")


def _hf_rope_scaling(hf: dict[str, object]) -> dict[str, object] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    return dict(scaling, rope_type=kind)


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], path: Path) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    parts = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
             "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    if config.gemma:
        parts += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        required += [f"{p}{part}.weight" for part in parts]
        required += ([p + ROUTER, p + GATE_UP, p + DOWN] if i in config.moe_layers else
                     [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                      p + "mlp.down_proj.weight"])
    missing = [name for name in required if name not in weights]
    if missing:
        raise ModelLoadError(f"{path}: missing {len(missing)} weight tensors, e.g. {missing[:3]}")
    _check_expert_shapes(config, weights, path)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    expected = (config.num_heads * config.head_dim, config.hidden_size)
    if tuple(q.shape) != expected:
        raise ModelLoadError(f"{path}: q_proj has shape {tuple(q.shape)}, expected {expected}")
    if not math.isfinite(float(weights["model.norm.weight"].float().sum())):
        raise ModelLoadError(f"{path}: non-finite values in model.norm.weight")


def _check_expert_shapes(config: ModelConfig, weights: dict[str, torch.Tensor],
                         path: Path) -> None:
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    expected = {ROUTER: (e, h), GATE_UP: (e, 2 * i, h), DOWN: (e, h, i)}
    for layer in config.moe_layers:
        for part, shape in expected.items():
            name = f"model.layers.{layer}.{part}"
            if tuple(weights[name].shape) != shape:
                raise ModelLoadError(f"{path}: {name} has shape {tuple(weights[name].shape)}, "
                                     f"expected {shape}")
