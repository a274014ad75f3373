"""Llama-family decoder in plain PyTorch over a paged KV cache.

Covers Llama 2/3 (incl. Llama-3 RoPE scaling), SmolLM2, Mistral, Phi-3, Qwen2 (q/k/v bias), Qwen3
(q/k norm), Qwen3-MoE (Qwen3 with mixture-of-experts MLPs: ``moe.py``), Gemma 2 and Gemma 3
(text). Numerics follow Hugging Face's implementation (RMSNorm
in float32, rotate-half RoPE) so greedy output matches transformers on the same weights. With
the triton attention backend a layer's small ops (norms, residual adds, rotary embedding with
the K/V store, SiLU's product) run as fused Triton kernels rounding where torch rounds
(``attention/triton_ops.py``).

Gemma (``_gemma_layer``, torch ops only): embeddings times sqrt(hidden_size) in the model
dtype, RMSNorm as ``x * (1 + weight)`` rounded after the product, four norms a layer (input,
the attention's output, before the MLP, the MLP's output), GELU (tanh) MLP, final logits
soft-capped. Each layer tells the attention backend its query scale (``query_pre_attn_scalar``),
sliding window and logit soft-capping (Gemma 2) as a ``LayerAttention``; only the torch backend
computes those, so a Gemma model runs on it. Gemma 3 normalises q and k per head and its
sliding layers take their own RoPE tables (``rope_local_theta``, unscaled).

Tensor parallelism (``Shard``): a rank keeps a contiguous run of KV heads with their query
heads (q/k/v rows and the o columns of those heads, biases with their rows) and a contiguous
run of the MLP's intermediate columns (gate and up rows, down columns); o and down give partial
sums that ``all_reduce`` adds up across the ranks. Embedding, norms (Qwen3's q/k norms are per
head dim) and the head are replicated; only rank 0 runs the head. Splits may be uneven (3 KV
heads over 2 ranks: 2 and 1). A mixture-of-experts model runs on one rank only.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention import AttentionBackend, check_features
from tandem.services.engine.config import ModelConfig
from tandem.services.engine.cpu_kernels import AmxLinear, Linear, packing_available
from tandem.services.engine.cpu_layers import CpuLayers
from tandem.services.engine.int4_linear import Int4Linear, Q4Weight
from tandem.services.engine.kv_cache import KVCache
from tandem.services.engine.layer import Layer, Projection
from tandem.services.engine.moe import MoeMlp

if TYPE_CHECKING:
    from tandem.services.engine.attention.triton_backend import TritonAttention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``scale`` (1 + weight, float32) multiplies before the rounding."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def norm_scale(config: ModelConfig, weight: torch.Tensor) -> torch.Tensor:
    """What a norm's weight multiplies the normalised activations by: Gemma's 1 + weight in
    float32, else the weight."""
    return 1.0 + weight.float() if config.gemma else weight


def rope_tables(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] of the rotary embedding."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float()
                                            / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind is not None:
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, object]) -> torch.Tensor:
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    low = float(scaling.get("low_freq_factor", 1.0))  # type: ignore[arg-type]
    high = float(scaling.get("high_freq_factor", 4.0))  # type: ignore[arg-type]
    old_len = float(scaling.get("original_max_position_embeddings", 8192))  # type: ignore[arg-type]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


# The MLP's gate activations by Hugging Face name (ModelConfig.hidden_act).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _triton_ops() -> ModuleType:
    """Our fused Triton kernels' module (imported only with the triton backend: Triton is
    optional on a CPU)."""
    from tandem.services.engine.attention import triton_ops
    return triton_ops


def split_evenly(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous runs, the first ``n % parts``
    one longer."""
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


@dataclass(frozen=True)
class Shard:
    """One rank's part of a tensor-parallel model."""

    rank: int
    world_size: int
    kv_heads: range  # its KV heads; query heads kv * group .. travel with them
    mlp: range  # its intermediate columns

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int) -> Shard:
        if world_size > config.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {world_size} is more than the model's "
                             f"{config.num_kv_heads} KV heads (each rank needs one)")
        if world_size > 1 and config.is_moe:
            raise ValueError(f"tensor_parallel_size {world_size} does not support "
                             f"mixture-of-experts models ({config.model_id}); use "
                             f"tensor_parallel_size 1")
        return cls(rank, world_size, split_evenly(config.num_kv_heads, world_size, rank),
                   split_evenly(config.intermediate_size, world_size, rank))

    @classmethod
    def whole(cls, config: ModelConfig) -> Shard:
        return cls.of(config, 0, 1)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` as this rank sees it: its heads and intermediate columns only."""
        group = config.num_heads // config.num_kv_heads
        return dataclasses.replace(config, num_kv_heads=len(self.kv_heads),
                                   num_heads=len(self.kv_heads) * group,
                                   intermediate_size=len(self.mlp))


def _shard_weights(w: dict[str, torch.Tensor], config: ModelConfig, shard: Shard
                   ) -> dict[str, torch.Tensor]:
    """The layer weights cut to ``shard`` (rows of q/k/v/gate/up, columns of o/down)."""
    if shard.world_size == 1:
        return w
    d, group = config.head_dim, config.num_heads // config.num_kv_heads
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    q = slice(kv.start * group, kv.stop * group)
    mlp = slice(shard.mlp.start, shard.mlp.stop)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    columns = {"o_proj": q, "down_proj": mlp}
    out = {}
    for name, tensor in w.items():
        kind = name.split(".")[-2] if name.startswith("model.layers.") else ""
        if kind in rows:  # weight [out, in] or bias [out]
            tensor = tensor[rows[kind]]
        elif kind in columns:
            tensor = tensor[:, columns[kind]]
        out[name] = tensor.contiguous()
    return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 attention: AttentionBackend, max_positions: int, device: str = "cpu",
                 shard: Shard | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None,
                 quantized: dict[str, Q4Weight] | None = None,
                 quantized_head: tuple[Q4Weight, ...] = (), kernel_threads: int = 1) -> None:
        """``shard``: this rank's part (None: the whole model); ``all_reduce`` sums a tensor
        in place across the ranks (needed when the shard is not the whole model).
        ``quantized``: Q4_1 weights by name (weight_format int4; a projection all of whose
        parts are there runs as an ``Int4Linear``, the others dense from ``weights``);
        ``quantized_head``: the output projection's int4 terms (a Q8_0 head), if any.
        ``kernel_threads``: the threads our AMX projections split over (1 or 2)."""
        super().__init__()
        check_features(attention.name, config.attention_features)
        self.config = config
        self.shard = shard or Shard.whole(config)
        if self.shard.world_size > 1 and all_reduce is None:
            raise ValueError("a sharded model needs an all_reduce")
        self.all_reduce = all_reduce
        local = self.shard.local_config(config)
        self.num_heads, self.num_kv_heads = local.num_heads, local.num_kv_heads
        self.attention = attention
        # The cpu backend's model runs RMSNorm, the rotary embedding and SwiGLU's product as
        # our fused kernels too (engine/cpu_kernels.py; bfloat16 only: a float32 cpu backend
        # has its decode kernel alone, and ``kernels`` None).
        self.kernels: cpu_kernels.Kernels | None = (
            getattr(attention, "kernels", None) if attention.name == "cpu" else None)
        # The triton backend's model runs each layer's small ops as our fused Triton kernels
        # (attention/triton_ops.py: the norms with the residual adds before them, the rotary
        # embedding with the K/V store, SiLU with the product): ``_fused_layers``.
        self.triton_ops = _triton_ops() if attention.name == "triton" else None
        self.kernel_threads = kernel_threads
        w = {name: t.to(device)
             for name, t in _shard_weights(weights, config, self.shard).items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = norm_scale(config, w["model.norm.weight"])
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model dtype.
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5).to(self.embed.dtype)
                            if config.gemma else None)
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        pack = packing_available(device, self.embed.dtype)  # oneDNN-ordered weights on a CPU
        quantized = quantized or {}
        if (quantized or quantized_head) and (self.shard.world_size > 1
                                              or torch.device(device).type != "cpu"):
            raise ValueError("int4 weights run on one CPU rank only")

        def dense(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  swiglu: bool = False) -> Linear | AmxLinear:
            """A dense projection: our AMX kernel with the cpu backend where it runs (a gate
            and up projection then also computing the SwiGLU activation: ``swiglu``), else
            torch (oneDNN-packed on a CPU)."""
            if AmxLinear.usable(self.kernels, weight, swiglu):
                assert self.kernels is not None
                return AmxLinear.of(self.kernels, weight, bias, swiglu, kernel_threads)
            return Linear.of(weight, bias, pack)

        self.head = (Int4Linear.of(quantized_head, pack=pack, dense=dense) if quantized_head
                     else dense(self.lm_head))

        def linear(names: list[str], bias: torch.Tensor | None = None,
                   swiglu: bool = False) -> Projection:
            """The fused projection of ``names`` (stacked along their outputs)."""
            if all(name in quantized for name in names):
                return Int4Linear.of(Q4Weight.cat([quantized[n] for n in names]), bias, pack,
                                     dense=dense)
            return dense(torch.cat([w[n] for n in names]) if len(names) > 1 else w[names[0]],
                         bias, swiglu)

        def norm(name: str) -> torch.Tensor | None:
            weight = w.get(name + ".weight")
            return None if weight is None else norm_scale(config, weight)

        gemma = config.gemma
        self.layers: list[Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn_bias = None
            if config.attention_bias:
                attn_bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            input_norm = norm(p + "input_layernorm")
            # The norm before the MLP; Gemma's post_attention_layernorm is the attention's
            # output norm.
            mlp_norm = norm(p + ("pre_feedforward_layernorm" if gemma
                                 else "post_attention_layernorm"))
            assert input_norm is not None and mlp_norm is not None  # _check_weights
            moe = MoeMlp.of(w, p, config) if i in config.moe_layers else None
            self.layers.append(Layer(
                input_norm=input_norm,
                post_norm=mlp_norm,
                qkv=linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"], attn_bias),
                o=linear([p + "self_attn.o_proj.weight"]),
                q_norm=norm(p + "self_attn.q_norm"),
                k_norm=norm(p + "self_attn.k_norm"),
                gate_up=None if moe else linear([p + "mlp.gate_proj.weight",
                                                 p + "mlp.up_proj.weight"],
                                                swiglu=config.hidden_act == "silu"),
                down=None if moe else linear([p + "mlp.down_proj.weight"]),
                moe=moe,
                attn_out_norm=norm(p + "post_attention_layernorm") if gemma else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm") if gemma else None,
                attention=config.layer_attention(i),
                local_rope=config.rope_local_theta is not None and config.is_sliding(i),
            ))
        dtype = self.embed.dtype
        self.cos, self.sin = rope_tables(rope_inv_freq(config), max_positions, dtype, device)
        self.local_cos, self.local_sin = self.cos, self.sin
        if config.rope_local_theta is not None:  # Gemma 3's sliding layers: unscaled
            unscaled = dataclasses.replace(config, rope_theta=config.rope_local_theta,
                                           rope_scaling=None)
            self.local_cos, self.local_sin = rope_tables(rope_inv_freq(unscaled),
                                                         max_positions, dtype, device)
        # With the cpu backend, a step's layers in one C call where they fit it (cpu_layers.py).
        self.cpu_layers = CpuLayers.of(
            self.kernels, self.layers, attention, self.num_heads, self.num_kv_heads,
            config.head_dim, local.intermediate_size, config.rms_norm_eps, self.cos, self.sin,
            kernel_threads, sharded=self.shard.world_size > 1 or all_reduce is not None)

    def with_attention(self, attention: AttentionBackend) -> LlamaModel:
        """This model's weights behind another attention backend (the GPU check compares
        backends on one set of weights). Not to or from the cpu backend, whose kernels the
        layers were built for."""
        if "cpu" in (attention.name, self.attention.name):
            raise ValueError("the cpu backend's layers are built for it: load the model again")
        check_features(attention.name, self.config.attention_features)
        other = copy.copy(self)
        other.attention = attention
        other.triton_ops = _triton_ops() if attention.name == "triton" else None
        return other

    def first_layers(self, num_layers: int) -> LlamaModel:
        """A model of this one's first ``num_layers`` layers plus its final norm and head,
        sharing every weight (the self-draft for speculative decoding)."""
        draft = copy.copy(self)
        draft.config = dataclasses.replace(self.config, num_layers=num_layers,
                                           layer_types=self.config.layer_types[:num_layers])
        draft.layers = self.layers[:num_layers]
        return draft

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                plan: Any, logits_indices: torch.Tensor) -> torch.Tensor:
        """Run the step's flat token batch; return float32 logits for ``logits_indices`` rows.
        ``plan``: the attention backend's ``prepare`` of the step's metadata."""
        x = self.hidden(input_ids, positions, kv_cache, plan)
        logits = self.head(self._norm(x[logits_indices], self.norm))
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers caps them
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
               plan: Any) -> torch.Tensor:
        """Every layer over the step's tokens (storing their K/V): the last hidden states.
        A tensor-parallel follower runs only this."""
        if self.config.gemma:
            return self._gemma_layers(input_ids, positions, kv_cache, plan)
        if self.triton_ops is not None:
            return self._fused_layers(F.embedding(input_ids, self.embed), positions, kv_cache,
                                      plan)
        c = self.config
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        kernels = self.kernels
        # The kernel indexes the tables by position itself (int64, converted once a step).
        if kernels is not None:
            cos, sin, positions = self.cos, self.sin, positions.to(torch.int64).contiguous()
        else:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
        threads = self.kernel_threads
        x = F.embedding(input_ids, self.embed)
        if self.cpu_layers is not None:  # every layer in one call, where the step fits it
            done = self.cpu_layers.run(x, positions, kv_cache, plan, len(self.layers))
            if done is not None:
                return done
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.input_norm)
            qkv = layer.qkv(h)
            q = qkv[:, :q_size].view(-1, heads, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
            if kernels is not None:
                q, k = kernels.rotary(q, k, cos, sin, positions, threads)
            else:
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
            attn = self.attention.forward(index, q, k, v, kv_cache, plan, layer.attention)
            x = self._add(x, layer.o, attn)
            h = self._norm(x, layer.post_norm)
            if layer.moe is not None:
                x = x + layer.moe(h)
                continue
            assert layer.gate_up is not None and layer.down is not None
            if isinstance(layer.gate_up, AmxLinear) and layer.gate_up.swiglu:
                act = layer.gate_up(h)  # the activation straight from the projection
            elif kernels is not None:
                act = kernels.silu_mul(layer.gate_up(h))
            else:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                act = F.silu(gate) * up
            x = self._add(x, layer.down, act)
        return x

    def _gemma_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: KVCache, plan: Any) -> torch.Tensor:
        """``hidden`` for Gemma 2/3."""
        assert self.embed_scale is not None
        x = F.embedding(input_ids, self.embed) * self.embed_scale
        rope = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        local_rope = rope
        if self.local_cos is not self.cos:
            local_rope = (self.local_cos[positions].unsqueeze(1),
                          self.local_sin[positions].unsqueeze(1))
        for index, layer in enumerate(self.layers):
            x = self._gemma_layer(index, layer, x, local_rope if layer.local_rope else rope,
                                  kv_cache, plan)
        return x

    def _gemma_layer(self, index: int, layer: Layer, x: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, plan: Any
                     ) -> torch.Tensor:
        """One Gemma decoder layer over ``x``: its attention (as ``layer.attention`` says)
        and its MLP, each output normalised before its residual add."""
        assert layer.attn_out_norm is not None and layer.mlp_out_norm is not None
        c = self.config
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        qkv = layer.qkv(self._norm(x, layer.input_norm))
        q = qkv[:, :q_size].view(-1, self.num_heads, c.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        attn = self.attention.forward(index, q, k, v, kv_cache, plan, layer.attention)
        x = x + self._norm(self._reduced(layer.o(attn)), layer.attn_out_norm)
        gate, up = layer.gate_up(self._norm(x, layer.post_norm)).chunk(2, dim=-1)
        out = layer.down(ACTIVATIONS[c.hidden_act](gate) * up)
        return x + self._norm(self._reduced(out), layer.mlp_out_norm)

    def _fused_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                      plan: Any) -> torch.Tensor:
        """``hidden``'s layers with the triton backend: the same ops, the small ones as our
        fused kernels (a layer launches its 4 projections, 2 norms, the rotary embedding with
        the K/V store, the attention and SiLU's product); the residual adds take the
        projections' outputs once summed over the ranks."""
        ops, eps = self.triton_ops, self.config.rms_norm_eps
        assert ops is not None
        attention = cast("TritonAttention", self.attention)
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            q = ops.rotary_store(layer.qkv(h), positions, self.cos, self.sin, kv_cache, index,
                                 plan.step.slot_mapping, self.num_heads, self.num_kv_heads,
                                 layer.q_norm, layer.k_norm, eps)
            attn = attention.attend(index, q, kv_cache, plan)  # K/V stored above
            x, h = ops.add_rms_norm(x, self._reduced(layer.o(attn)), layer.post_norm, eps)
            if layer.moe is not None:
                out = layer.moe(h)
            else:
                assert layer.gate_up is not None and layer.down is not None
                out = self._reduced(layer.down(ops.silu_mul(layer.gate_up(h))))
            if index + 1 < len(self.layers):
                x, h = ops.add_rms_norm(x, out, self.layers[index + 1].input_norm, eps)
            else:  # the final norm runs on the logits rows only (``forward``)
                x = x + out
        return x

    def _add(self, x: torch.Tensor, projection: Projection, h: torch.Tensor) -> torch.Tensor:
        """``x + projection(h)`` (the projection summed over the ranks first); our AMX kernel
        adds it into ``x`` in place as it writes the projection (the same bits)."""
        if isinstance(projection, AmxLinear) and self.all_reduce is None:
            return projection(h, residual=x)
        return x + self._reduced(projection(h))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.config.gemma:  # ``weight``: 1 + Gemma's weight (``norm_scale``)
            return gemma_rms_norm(x, weight, self.config.rms_norm_eps)
        if self.triton_ops is not None:
            return self.triton_ops.rms_norm(x, weight, self.config.rms_norm_eps)
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.config.rms_norm_eps,
                                         self.kernel_threads)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-sharded projection's output summed over the ranks (as is on one rank)."""
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial
