"""Qwen3-MoE's sparse MLP: a router picks each token's top k of a layer's experts (SwiGLU MLPs
of ``moe_intermediate_size``), and the token's output is their outputs weighted by the router's
probabilities (renormalised over the k when ``norm_topk_prob``).

Numerics follow transformers' ``Qwen3MoeSparseMoeBlock``: router logits in the model dtype,
their softmax in float32, the top k, the weights cast back to the model dtype; each expert's
output scaled by its weight and added into its tokens' rows, experts in index order.

The experts run grouped: a step's (token, expert) pairs are sorted by expert and each expert
that has any runs once, on its group of tokens. Its weights are stacked per layer at load time
(``model_loader``), under transformers' names: ``mlp.gate.weight`` [experts, hidden],
``mlp.experts.gate_up_proj`` [experts, 2 * intermediate, hidden] (an expert's gate rows, then
its up rows) and ``mlp.experts.down_proj`` [experts, hidden, intermediate].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.services.engine.config import ModelConfig

ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"


@dataclass(frozen=True)
class MoeMlp:
    """One layer's router and stacked experts."""

    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * intermediate, hidden]
    down: torch.Tensor  # [experts, hidden, intermediate]
    top_k: int
    norm_topk_prob: bool

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> MoeMlp:
        """Layer ``prefix``'s (``model.layers.N.``) block from the stacked weights."""
        return cls(weights[prefix + ROUTER], weights[prefix + GATE_UP], weights[prefix + DOWN],
                   config.num_experts_per_tok, config.norm_topk_prob)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` [tokens, hidden] (normed), in x's dtype."""
        weights, experts = self.route(x)
        return self.run_experts(x, weights, experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k router weights (x's dtype) and experts, [tokens, k] each."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                    ) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(token): every expert with tokens
        runs once on its group (one host sync for the group sizes)."""
        out = torch.zeros_like(x)
        pairs = experts.flatten()  # pair i: token i // k's (i % k)-th expert
        order = torch.argsort(pairs, stable=True)
        sizes = torch.bincount(pairs, minlength=self.gate_up.shape[0]).tolist()
        scale = weights.flatten()
        for expert, group in enumerate(order.split(sizes)):
            if group.numel():
                rows = group // self.top_k
                out.index_add_(0, rows, self._expert(expert, x[rows]) * scale[group, None])
        return out

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[expert])

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.router, self.gate_up, self.down))
