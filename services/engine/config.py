"""Configuration dataclasses for the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from a GGUF file or a Hugging Face config.json."""

    model_id: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalises q and k per head

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )


@dataclass
class EngineConfig:
    """How an engine runs a model. Defaults suit the built-in model on a small CPU."""

    model: str | None = None  # path to a .gguf file or a HF directory; None = built-in model
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 32  # running batch size cap
    max_num_batched_tokens: int = 512  # per-step token budget (= prefill chunk size)
    max_waiting: int = 1024  # admission control: add_request fails beyond this
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    attention_backend: str = "torch"
    seed: int = 0  # for requests that sample without their own seed
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
