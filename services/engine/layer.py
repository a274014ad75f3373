"""A decoder layer's weights, as the model and the CPU layers' kernel both read them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.services.engine.config import PLAIN_ATTENTION, LayerAttention
from tandem.services.engine.cpu_kernels import AmxLinear, Linear
from tandem.services.engine.int4_linear import Int4Linear
from tandem.services.engine.moe import MoeMlp

Projection = Linear | AmxLinear | Int4Linear


@dataclass(frozen=True)
class Layer:
    """One decoder layer's weights: q/k/v and gate/up fused into one projection each. A
    mixture-of-experts layer (Qwen3-MoE) has ``moe`` in place of gate_up and down.

    Norms hold what multiplies the normalised activations: the weight, or Gemma's
    ``1 + weight`` in float32 (its RMSNorm rounds after that product)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the norm before the MLP (Gemma's pre_feedforward_layernorm)
    qkv: Projection
    o: Projection
    q_norm: torch.Tensor | None  # Qwen3, Gemma 3
    k_norm: torch.Tensor | None
    gate_up: Projection | None  # None: a mixture-of-experts layer
    down: Projection | None
    moe: MoeMlp | None = None
    # Gemma: the norms of the attention's and the MLP's outputs, before the residual adds
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    attention: LayerAttention = PLAIN_ATTENTION  # what the layer asks of the attention backend
    local_rope: bool = False  # Gemma 3's sliding layers: the local RoPE tables

    def weight_bytes(self) -> int:
        tensors = [self.input_norm, self.post_norm, self.q_norm, self.k_norm,
                   self.attn_out_norm, self.mlp_out_norm]
        for linear in (self.qkv, self.o, self.gate_up, self.down):
            if linear is not None:
                tensors += [linear.weight, linear.bias]
        experts = self.moe.weight_bytes() if self.moe is not None else 0
        return experts + sum(t.numel() * t.element_size() for t in tensors if t is not None)
