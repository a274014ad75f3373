"""Configuration dataclasses for the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"  # HF's layer_types

# What a layer's attention may ask of a backend beyond causal softmax(q k^T / sqrt(d)) v; only
# the torch backend implements them (attention/__init__.py: resolve_backend).
SLIDING_WINDOW = "sliding-window attention"
SOFTCAP = "attention logit soft-capping"
QUERY_SCALE = "a query scale other than head_dim ** -0.5 (query_pre_attn_scalar)"


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes: softmax over the causal keys of
    ``softcap * tanh(q k^T * scale / softcap)``, the keys cut to the last ``sliding_window``
    positions (the query's own included). The defaults are Llama's plain attention."""

    scale: float | None = None  # None: head_dim ** -0.5
    sliding_window: int | None = None  # None: every earlier key
    softcap: float | None = None  # None: no capping

    @property
    def features(self) -> frozenset[str]:
        """What this asks of a backend beyond plain attention."""
        asked = [(self.sliding_window is not None, SLIDING_WINDOW),
                 (self.softcap is not None, SOFTCAP), (self.scale is not None, QUERY_SCALE)]
        return frozenset(name for needed, name in asked if needed)


PLAIN_ATTENTION = LayerAttention()


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Gemma 2/3 included), read from a GGUF file or a Hugging
    Face config.json."""

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
    qk_norm: bool = False  # Qwen3 (and Gemma 3) normalise q and k per head
    # Gemma 2/3: RMSNorm as x * (1 + weight) in float32, norms on the attention's and the MLP's
    # outputs too (four a layer), embeddings times sqrt(hidden_size)
    gemma: bool = False
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (None: head_dim's)
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # the window of the layers layer_types marks sliding
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention; (): full
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base
    # Qwen3-MoE: the layers whose MLP is a mixture of experts (engine/moe.py; the others are
    # dense MLPs of intermediate_size): num_experts SwiGLU experts of moe_intermediate_size,
    # each token through its top num_experts_per_tok, their router weights renormalised to sum
    # to 1 when norm_topk_prob.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be silu or gelu_pytorch_tanh, got "
                             f"{self.hidden_act!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"unknown layer_types {sorted(unknown)}")
        if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError(f"sliding layers need a sliding_window > 0, got "
                             f"{self.sliding_window}")
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be "
                             f"between 1 and num_experts ({self.num_experts})")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def layer_attention(self, layer: int) -> LayerAttention:
        """What layer ``layer``'s attention computes (``PLAIN_ATTENTION`` for Llama's)."""
        scale = (None if self.query_pre_attn_scalar is None
                 else self.query_pre_attn_scalar ** -0.5)
        window = self.sliding_window if self.is_sliding(layer) else None
        return LayerAttention(scale, window, self.attn_logit_softcapping)

    @property
    def attention_features(self) -> frozenset[str]:
        """What the model's layers ask of an attention backend beyond plain attention."""
        return frozenset().union(*(self.layer_attention(i).features
                                   for i in range(self.num_layers)))

    @property
    def is_moe(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return bool(self.moe_layers)


SPEC_METHODS = ("none", "ngram", "draft", "self")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")  # engine/attention
FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn 2 pages KV in multiples of 256 tokens
KV_CACHE_DTYPES = ("auto", "int8")  # engine/kv_cache.py
WEIGHT_FORMATS = ("dense", "int4")  # engine/int4_linear.py


@dataclass
class SpeculativeConfig:
    """Speculative decoding on this engine (the decode role, or a colocated engine)."""

    method: str = "none"  # none | ngram (prompt lookup) | draft (a small model) | self
    k: int = 4  # draft tokens per step, at most; a request may ask for fewer
    draft_model: str | None = None  # method "draft": .gguf or HF dir sharing the tokenizer
    draft_kv_cache_memory_gb: float = 0.125  # the draft model's own paged KV cache
    self_draft_layers: int | None = None  # method "self": None = a quarter of the layers
    ngram_min: int = 1  # prompt lookup matches the last n tokens, n from ngram_max down
    ngram_max: int = 4
    # Load-adaptive policy: at most this many draft tokens per step across the batch (so k
    # shrinks as the batch grows and speculation stops past it), and a request whose recent
    # acceptance rate falls below min_acceptance pauses speculating for a while.
    adaptive: bool = True
    max_draft_tokens_per_step: int = 16
    min_acceptance: float = 0.25

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.k <= 16:
            raise ValueError(f"spec k must be between 1 and 16, got {self.k}")
        if self.self_draft_layers is not None and self.self_draft_layers < 1:
            raise ValueError(f"self_draft_layers must be >= 1, got {self.self_draft_layers}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.max_draft_tokens_per_step < 1:
            raise ValueError("max_draft_tokens_per_step must be >= 1")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class EngineConfig:
    """How an engine runs a model. Defaults suit the built-in model on a small CPU."""

    model: str | None = None  # .gguf file, HF directory or hub id; None = built-in model
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"
    block_size: int = 16
    # The KV cache (engine/kv_sizing.py): num_kv_blocks blocks, or kv_cache_memory_gb GiB of
    # them; neither: 1 GiB on a CPU, on a GPU gpu_memory_utilization of the device less what a
    # profiling step at the largest batch leaves in use
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    # auto: the cache holds `dtype`; int8: int8 values with a float32 scale per (slot, KV head)
    kv_cache_dtype: str = "auto"
    # The host-memory KV tier (host_kv_pool.py): evicted prefix-cache blocks kept in this much
    # host RAM (pinned on CUDA) and copied back on a hit; 0: off (needs enable_prefix_caching)
    host_kv_cache_gb: float = 0.0
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 32  # running batch size cap
    max_num_batched_tokens: int = 512  # per-step token budget (= prefill chunk size)
    max_waiting: int = 1024  # admission control: add_request fails beyond this
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # Threads our AMX projections split over (cpu backend, one torch thread; cpu_kernels.py):
    # 1, or 2 (a helper thread takes part of each projection when it can: late, it costs
    # nothing, the calling thread takes the rest).
    kernel_threads: int = 1
    # torch intra-op threads for a step that computes at least PREFILL_THREADS_MIN_TOKENS
    # prompt tokens (model_runner.py): prefill is compute-bound where torch runs the
    # projections (float32 on a CPU), decode bound by memory; None: num_threads for every step.
    prefill_threads: int | None = None
    attention_backend: str = "auto"  # auto | torch | cpu | triton | flash_attn (engine/attention)
    cuda_graphs: bool = True  # decode steps as CUDA graphs (on CUDA with triton attention)
    seed: int = 0  # for requests that sample without their own seed
    # The longest one step may run before AsyncEngine's health check calls the engine hung
    # (a kernel that never returns): its streams fail, new requests are refused and the check
    # fails, so Ray Serve replaces the worker. None: no limit (offline use).
    step_timeout_s: float | None = None
    # dense: every weight in `dtype`; int4: a GGUF's Q4_1 weights kept 4-bit for decode steps
    # of a few tokens (CPU, bfloat16, one rank; engine/int4_linear.py)
    weight_format: str = "dense"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Ranks the model's attention heads and MLP are split over (engine/tensor_parallel.py):
    # this process is rank 0 and starts the others; each rank has num_threads threads and a
    # KV cache of kv_cache_memory_gb for its own heads.
    tensor_parallel_size: int = 1
    # Each collective between the ranks (and each step message to one), at most; a rank that
    # takes longer (hung) stops the engine.
    tensor_parallel_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "flash_attn":
            if self.block_size % FLASH_ATTN_BLOCK_MULTIPLE:
                raise ValueError(f"attention_backend flash_attn needs block_size to be a "
                                 f"multiple of {FLASH_ATTN_BLOCK_MULTIPLE}, got "
                                 f"{self.block_size}")
            if self.dtype not in ("bfloat16", "float16"):
                raise ValueError(f"attention_backend flash_attn needs dtype bfloat16 or "
                                 f"float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "int8" and self.attention_backend in ("flash_attn", "cpu"):
            raise ValueError(f"kv_cache_dtype int8 needs attention_backend torch, triton or auto "
                             f"({self.attention_backend} reads only a 16-bit cache)")
        if self.attention_backend == "cpu" and self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"attention_backend cpu needs dtype bfloat16 or float32, got "
                             f"{self.dtype!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, "
                             f"got {self.weight_format!r}")
        if self.weight_format == "int4":
            self._check_int4()
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.host_kv_cache_gb >= 0:
            raise ValueError(f"host_kv_cache_gb must be >= 0, got {self.host_kv_cache_gb}")
        if self.kernel_threads not in (1, 2):
            raise ValueError(f"kernel_threads must be 1 or 2, got {self.kernel_threads}")
        if self.prefill_threads is not None and self.prefill_threads < 1:
            raise ValueError(f"prefill_threads must be >= 1, got {self.prefill_threads}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s must be > 0, got "
                             f"{self.tensor_parallel_timeout_s}")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()

    def _check_int4(self) -> None:
        refused = [(self.dtype != "bfloat16", f"dtype {self.dtype!r} (use bfloat16)"),
                   (self.device != "cpu", f"device {self.device!r} (use cpu)"),
                   (self.tensor_parallel_size != 1,
                    f"tensor_parallel_size {self.tensor_parallel_size} (use 1)")]
        for problem, what in refused:
            if problem:
                raise ValueError(f"weight_format int4 does not support {what}")

    def _check_tensor_parallel(self) -> None:
        """What a tensor-parallel engine does not do (each would touch the KV cache or the
        model on rank 0 alone)."""
        refused = [
            (self.host_kv_cache_gb > 0, "host_kv_cache_gb (the host KV tier)"),
            (self.speculative.method in ("draft", "self"),
             f"speculative method {self.speculative.method!r} (ngram works)"),
        ]
        for problem, what in refused:
            if problem:
                raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} does not "
                                 f"support {what}; use tensor_parallel_size 1")

