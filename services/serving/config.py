"""``AppConfig``: everything ``build_app`` needs, from one YAML file and/or CLI flags."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from tandem.router.config import POLICIES as ROUTING_POLICIES
from tandem.services.engine.config import (
    ATTENTION_BACKENDS,
    FLASH_ATTN_BLOCK_MULTIPLE,
    KV_CACHE_DTYPES,
    SPEC_METHODS,
    WEIGHT_FORMATS,
    EngineConfig,
    SpeculativeConfig,
)
from tandem.services.engine.tokenizer_loader import is_hub_id, read_chat_template
from tandem.services.gateway.tool_parsers import ALIASES as TOOL_PARSER_ALIASES
from tandem.services.gateway.tool_parsers import NAMES as TOOL_PARSERS
from tandem.services.kv_transfer.factory import NIXL_WITH_TLS, TRANSPORTS
from tandem.services.tls import InternalTLS, ServerTLS

REASONING_PARSERS = ("auto", "think", "none")
VLLM_REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names for what `think` does

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listen addresses meaning every address of the node


class ConfigError(ValueError):
    """A bad configuration value; the message names the field."""


@dataclass(frozen=True)
class AppConfig:
    # .gguf file, HF directory or hub id org/name[@revision] (huggingface_hub's cache; HF_HOME,
    # HF_HUB_OFFLINE); None: the built-in model
    model: str | None = None
    # auto: bfloat16 on a GPU, and on a CPU where our kernels run (AVX-512 BF16: the fast
    # path), else float32; float32 when asked (exact against transformers' float32)
    dtype: str = "auto"
    device: str = "auto"  # where engines run: auto (cuda when the worker sees a GPU) | cpu | cuda
    # auto (triton on CUDA; cpu, our C kernels, for bfloat16 or float32 on a CPU that runs
    # them; else torch) | torch | cpu | triton | flash_attn (the flash-attn package; blocks of a
    # multiple of 256 tokens: block_size defaults to 256 with it)
    attention_backend: str = "auto"
    cuda_graphs: bool = True  # decode steps replayed as CUDA graphs (CUDA + triton attention)
    block_size: int = 16  # tokens per KV block (the prefix cache's and KV transfers' unit)
    prefill_replicas: int = 1  # prefill workers (one engine each)
    decode_replicas: int = 1  # decode workers (one engine each)
    # Gateway replicas, one per node that declares gateway_resource (each serves HTTP and gRPC
    # on that node's port and grpc_port); more than one shares the router's index and stored
    # responses through redis_url, and each admits its share of max_in_flight.
    gateway_replicas: int = 1
    colocated: bool = False  # one engine in the gateway does both phases
    kv_transport: str = "auto"  # nixl | tcp | auto (NIXL when it loads)
    max_num_batched_tokens: int = 512  # per-step token budget (the prefill chunk size)
    max_num_seqs: int = 32  # sequences an engine steps at once, at most
    max_waiting: int = 1024  # queue limit per engine; beyond it requests get 429
    num_kv_blocks: int | None = None  # KV blocks per engine rank; None: sized as below
    # KV cache per engine rank in GiB; None: 1 on a CPU, on a GPU what gpu_memory_utilization
    # leaves after a profiling step (engine/kv_sizing.py)
    kv_cache_memory_gb: float | None = None
    # The share of a GPU's memory an engine takes: its weights, its largest step's activations,
    # then KV blocks for the rest (vLLM's --gpu-memory-utilization)
    gpu_memory_utilization: float = 0.9
    # auto: the KV cache holds `dtype`; int8: int8 values with a float32 scale per token and
    # KV head (about 1.9x the blocks of bfloat16 in the same memory; not with flash_attn)
    kv_cache_dtype: str = "auto"
    # The host-memory KV tier per engine: evicted prefix-cache blocks kept in this much host
    # RAM (pinned on CUDA) and copied back on a hit instead of recomputed; 0: off
    host_kv_cache_gb: float = 0.0
    # dense: every weight in `dtype`; int4: a GGUF's Q4_1 weights kept 4-bit, run by torch's
    # int4 kernel for decode steps of a few tokens (CPU, dtype bfloat16, tensor_parallel_size
    # 1; the scales rounded to bfloat16; docs/architecture.md "Linear layers")
    weight_format: str = "dense"
    # The longest prompt + output in tokens; None: the model's, capped by what the cache holds
    max_model_len: int | None = None
    # torch intra-op threads per engine rank; None: from the CPUs of the machine the engine
    # runs on, (cpus - 1) // ranks on it, at least 1 (``engine_threads``)
    threads_per_worker: int | None = None
    # Threads our CPU kernels (AMX projections, decode attention) split over per engine, with
    # the cpu backend and one torch thread: 1 or 2 (a helper thread takes part of each call
    # when it can; busy elsewhere, it costs nothing). None: 2 where the engine has one torch
    # thread and the CPUs give each engine rank two (``engine_kernel_threads``), else 1.
    kernel_threads: int | None = None
    # torch threads per engine rank in a step that computes at least 32 prompt tokens (a
    # prefill chunk; engine/model_runner.py), where decode steps keep threads_per_worker. None:
    # 2 where torch computes the projections (float32 on a CPU), the engine has one torch
    # thread and the CPUs give each engine rank two (``engine_prefill_threads``), else
    # threads_per_worker.
    prefill_threads: int | None = None
    # Ranks per engine, every role (prefill, decode, colocated): its attention heads and MLP
    # split over this many processes, one GPU each on CUDA (engine/tensor_parallel.py); KV
    # transfers move canonical blocks, gathered from / scattered to the ranks, so a prefill
    # and a decode engine need not agree on it.
    tensor_parallel_size: int = 1
    # An existing Ray cluster for `tandem up` to deploy into (`ray start --head`'s address,
    # host:port, or "auto"); None: `tandem up` starts a private one on this machine. On the way
    # out it deletes only its application; the cluster stays up.
    ray_address: str | None = None
    # Where each role's replicas run on a cluster of several nodes: the name of a Ray custom
    # resource the node must declare (`ray start --resources='{"NAME": 1}'`); each replica needs
    # 0.001 of it, so it only places it (a gateway replica takes a whole one: its ports are the
    # node's). None: any node.
    gateway_resource: str | None = None
    prefill_resource: str | None = None  # the same for prefill replicas
    decode_resource: str | None = None  # the same for decode replicas
    host: str = "127.0.0.1"  # HTTP and gRPC listen address
    port: int = 8000  # HTTP (OpenAI API, /health, /metrics)
    grpc_port: int = 50051  # gRPC streaming API
    worker_host: str = "127.0.0.1"  # where workers' control and KV ports listen
    # The router's prefix index and worker registry, and /v1/responses' stored responses, in
    # this Redis; None: in the gateway's process
    redis_url: str | None = None
    routing_policy: str = "prefix"  # prefix (cache affinity + load) | round_robin (baseline)
    # A prompt cached on a decode worker but for at most this many tokens (a session's next
    # turn: the last prompt and reply, plus the new message) is prefilled there, skipping the
    # prefill worker and the KV transfer; 0: only when all its full blocks are cached there.
    max_local_prefill_tokens: int = 0
    # The model's name in the API, or several (a request may name any; responses and
    # /v1/models' first card carry the first); None: its own id
    served_model_name: str | list[str] | None = None
    # Reuse the KV of prompt prefixes computed before (off: every prompt computed whole)
    enable_prefix_caching: bool = True
    # Seeds for sampled requests that bring none are drawn from this: a fresh server gives the
    # same outputs to the same requests sent in the same order. None: random seeds
    seed: int | None = None
    # The chat template: a file, or the template itself; None: the model's own
    chat_template: str | None = None
    # Request defaults (temperature, top_p, ...): auto (the model's generation_config.json),
    # vllm (none: the API's defaults) or a folder holding a generation_config.json
    generation_config: str = "auto"
    # Chat replies' <think>...</think> apart, as reasoning_content (gateway/reasoning.py):
    # auto (where the vocabulary has both tags as tokens: Qwen3, DeepSeek-R1, ...), think
    # (always), none; vLLM's parser names deepseek_r1 and qwen3 mean think.
    reasoning_parser: str = "auto"
    # How replies under tool_choice auto write tool calls (gateway/tool_parsers.py): auto (the
    # chat template's format; hermes where it shows none), hermes, mistral, llama3_json,
    # pythonic, qwen3_coder; vLLM's names llama4_json, llama4_pythonic and qwen3_xml too.
    tool_call_parser: str = "auto"
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before parsing
    lease_ttl_s: float = 30.0  # a prefill's pinned KV is freed this long after its first token
    poll_interval_s: float = 0.5  # gateway polls workers' load, stats (and events) this often
    # ... and this often once no request has been in flight for a while (an idle cluster)
    idle_poll_interval_s: float = 5.0
    spec: str = "none"  # speculative decoding on decode engines: none | ngram | draft | self
    spec_k: int = 4  # draft tokens per step, at most
    draft_model: str | None = None  # spec "draft": .gguf or HF dir sharing the tokenizer
    # Failure semantics (docs/operations.md "Deadlines and overload"): every hop has a timeout.
    request_timeout_s: float = 600.0  # a whole request, at most (a client may ask for less)
    prefill_timeout_s: float = 60.0  # a prefill call; then another worker (or D) prefills
    control_timeout_s: float = 5.0  # pair / release / reject between workers
    kv_transfer_timeout_s: float = 10.0  # one KV pull; then D recomputes the prompt
    stream_idle_timeout_s: float = 60.0  # the longest a request waits for its next decode output
    # One engine step, at most: longer, the worker is hung (its streams fail with a clear
    # error, its health check fails and Serve replaces it).
    step_timeout_s: float = 120.0
    client_read_timeout_s: float = 60.0  # a streaming client that reads nothing this long: cut
    # A request's headers must arrive within this of its connection's opening (or of its first
    # byte on a reused connection); else 408 and the connection closed
    http_header_timeout_s: float = 20.0
    http_body_timeout_s: float = 60.0  # its body within this of its headers; else 408, closed
    max_connections: int = 1024  # open HTTP connections at once; beyond them 503
    max_grpc_streams: int = 1024  # gRPC calls at once; beyond them RESOURCE_EXHAUSTED
    # Decode worker failures a stream survives (it moves on, exactly); the next worker that
    # fails while running it fails it (500: it may be a poison request)
    max_migrations: int = 1
    # A worker Serve stops (scale-down, upgrade, a draining node) finishes its calls for this
    # long; then it is stopped and its streams migrate.
    drain_timeout_s: float = 30.0
    # Admission: requests in flight at the gateways, at most (each gateway replica admits its
    # share); beyond it 429 with Retry-After. None: one decode batch per healthy decode worker
    # (max_num_seqs each, followed as workers come and go; colocated: max_num_seqs), so an
    # admitted request waits for its prefill, not for a decode slot (loadtest/overload.py).
    max_in_flight: int | None = None
    # One tenant's requests in flight at the gateways, at most; beyond it 429. None: with
    # several tenants in api_keys_file, the admission bound less a quarter (kept free for the
    # other tenants, so a flooding one cannot hold every slot); one tenant: no cap.
    tenant_max_in_flight: int | None = None
    # Tenants and keys (services/gateway/tenants.py, docs/operations.md "Security").
    api_keys_file: str | None = None  # `tenant:key` lines; None: no authentication
    # >= 32 characters; keys the tenants' prefix-cache salts and authenticates the workers'
    # traffic (control channel, KV reads). None: `tandem up` makes one per run (the chart
    # mounts one from a Secret); needed with api_keys_file.
    cluster_secret_file: str | None = None
    metrics_require_key: bool = False  # /metrics needs an API key too (/health never does)
    # Origins whose browser pages may call the HTTP API (CORS: e.g. https://app.example.com);
    # None: none, the default ("*": any origin; API keys still apply).
    cors_allow_origins: str | list[str] | None = None
    # Rate limits, per tenant (each gateway replica enforces an equal share); None: no limit
    tenant_requests_per_minute: int | None = None
    tenant_tokens_per_minute: int | None = None  # prompt + max_tokens, per tenant; None: none
    # TLS for HTTP and gRPC (PEM files, read by the gateway at start; the chart mounts them
    # from a Secret): both or neither. Set, the ports serve TLS only.
    tls_cert_file: str | None = None  # the certificate, then any intermediates
    tls_key_file: str | None = None  # its private key, unencrypted
    # Mutual TLS for KV bytes between workers (the TCP transport; PEM files every worker reads;
    # the chart mounts them from a Secret): all three or none. Set, kv_transport auto is TCP
    # over TLS and nixl is refused (NIXL's UCX moves bytes unencrypted).
    internal_tls_cert_file: str | None = None  # this worker's certificate, signed by the CA
    internal_tls_key_file: str | None = None  # its private key, unencrypted
    internal_tls_ca_file: str | None = None  # the CA whose certificates a worker accepts

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ConfigError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, "
                              f"got {self.routing_policy!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
        if (self.attention_backend == "flash_attn"
                and self.block_size % FLASH_ATTN_BLOCK_MULTIPLE):
            raise ConfigError(f"attention_backend flash_attn needs block_size to be a multiple "
                              f"of {FLASH_ATTN_BLOCK_MULTIPLE} (flash-attn's KV pages), got "
                              f"{self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "int8" and self.attention_backend in ("flash_attn", "cpu"):
            raise ConfigError(f"kv_cache_dtype int8 needs attention_backend auto, triton or "
                              f"torch ({self.attention_backend} reads only a 16-bit cache)")
        if self.attention_backend == "cpu" and self.dtype not in ("bfloat16", "float32", "auto"):
            raise ConfigError(f"attention_backend cpu needs dtype bfloat16 or float32 (its "
                              f"kernels read those caches), got {self.dtype!r}")
        _at_least("host_kv_cache_gb", self.host_kv_cache_gb, 0)
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, "
                              f"got {self.weight_format!r}")
        if self.weight_format == "int4":
            self._check_int4()
        if self.kv_transport not in TRANSPORTS:
            raise ConfigError(f"kv_transport must be one of {', '.join(TRANSPORTS)}, "
                              f"got {self.kv_transport!r}")
        for name in ("block_size", "prefill_replicas", "decode_replicas", "gateway_replicas",
                     "max_num_batched_tokens", "max_num_seqs", "max_waiting",
                     "tensor_parallel_size", "max_connections", "max_grpc_streams"):
            _at_least(name, getattr(self, name), 1)
        _at_least("max_local_prefill_tokens", self.max_local_prefill_tokens, 0)
        if self.gateway_replicas > 1:
            self._check_gateways()
        for name in ("num_kv_blocks", "max_model_len", "threads_per_worker"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be 0..65535, got {getattr(self, name)}")
        if self.port and self.port == self.grpc_port:
            raise ConfigError(f"port and grpc_port must differ, both are {self.port}")
        if self.kernel_threads not in (None, 1, 2):
            raise ConfigError(f"kernel_threads must be 1 or 2, got {self.kernel_threads}")
        if self.prefill_threads is not None:
            _at_least("prefill_threads", self.prefill_threads, 1)
        if self.max_in_flight is not None:
            _at_least("max_in_flight", self.max_in_flight, 1)
        if self.tenant_max_in_flight is not None:
            _at_least("tenant_max_in_flight", self.tenant_max_in_flight, 1)
        for name in ("tenant_requests_per_minute", "tenant_tokens_per_minute"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        if self.api_keys_file is not None and self.cluster_secret_file is None:
            raise ConfigError("api_keys_file needs cluster_secret_file (it keys the tenants' "
                              "prefix-cache salts); `tandem up` makes one")
        if self.metrics_require_key and self.api_keys_file is None:
            raise ConfigError("metrics_require_key needs api_keys_file")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (("tls_cert_file", "tls_key_file") if self.tls_key_file is None
                              else ("tls_key_file", "tls_cert_file"))
            raise ConfigError(f"{given} needs {missing} (TLS takes both or neither)")
        internal = {name: getattr(self, name) for name in InternalTLS.SETTINGS}
        if any(internal.values()):
            if missing_tls := [name for name, path in internal.items() if path is None]:
                raise ConfigError(f"internal TLS takes all three files or none: "
                                  f"{', '.join(missing_tls)} not set")
            if self.kv_transport == "nixl":
                raise ConfigError(NIXL_WITH_TLS)
        _at_least("max_migrations", self.max_migrations, 0)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        for name in ("lease_ttl_s", "poll_interval_s",
                     "idle_poll_interval_s", "request_timeout_s", "prefill_timeout_s",
                     "control_timeout_s", "kv_transfer_timeout_s", "stream_idle_timeout_s",
                     "step_timeout_s", "client_read_timeout_s", "drain_timeout_s",
                     "http_header_timeout_s", "http_body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.spec not in SPEC_METHODS:
            raise ConfigError(f"spec must be one of {', '.join(SPEC_METHODS)}, got {self.spec!r}")
        if not 1 <= self.spec_k <= 16:
            raise ConfigError(f"spec_k must be between 1 and 16, got {self.spec_k}")
        if self.spec == "draft" and self.draft_model is None:
            raise ConfigError("spec: draft needs draft_model (a .gguf file or a Hugging Face "
                              "directory sharing the model's tokenizer)")
        if self.draft_model is not None and not Path(self.draft_model).exists():
            raise ConfigError(f"draft_model: {self.draft_model} does not exist")
        if (self.model is not None and not Path(self.model).exists()
                and not is_hub_id(self.model)):
            raise ConfigError(f"model: {self.model} does not exist (nor is it a Hugging Face "
                              f"id, org/name[@revision])")
        for name in ("served_model_name", "cors_allow_origins"):
            value = getattr(self, name)
            if isinstance(value, list) and not all(isinstance(n, str) and n
                                                   for n in value or [""]):
                raise ConfigError(f"{name} must be a name or a list of names, got {value!r}")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # neither a file nor a template: refused
        if self.reasoning_parser not in (*REASONING_PARSERS, *VLLM_REASONING_PARSERS):
            raise ConfigError(f"reasoning_parser must be one of "
                              f"{', '.join((*REASONING_PARSERS, *VLLM_REASONING_PARSERS))}, got "
                              f"{self.reasoning_parser!r}")
        if self.tool_call_parser not in (*TOOL_PARSERS, *TOOL_PARSER_ALIASES):
            raise ConfigError(f"tool_call_parser must be one of "
                              f"{', '.join((*TOOL_PARSERS, *TOOL_PARSER_ALIASES))}, got "
                              f"{self.tool_call_parser!r}")
        if self.generation_config not in ("auto", "vllm") and not (
                Path(self.generation_config) / "generation_config.json").is_file():
            raise ConfigError(f"generation_config must be auto, vllm or a folder holding a "
                              f"generation_config.json, got {self.generation_config!r}")
        if self.tensor_parallel_size > 1:
            refused = [(self.host_kv_cache_gb > 0, "host_kv_cache_gb (the host KV tier)"),
                       (self.spec in ("draft", "self"), f"spec {self.spec!r} (ngram works)")]
            for problem, what in refused:
                if problem:
                    raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size} does "
                                      f"not support {what}; use tensor_parallel_size 1")
        if self.redis_url is not None and not self.redis_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, "
                              f"got {self.redis_url!r}")

    def _check_int4(self) -> None:
        refused = [(self.dtype not in ("bfloat16", "auto"), f"dtype {self.dtype!r} (use "
                                                             f"bfloat16)"),
                   (self.device == "cuda", "device 'cuda' (use cpu or auto on a CPU)"),
                   (self.tensor_parallel_size != 1,
                    f"tensor_parallel_size {self.tensor_parallel_size} (use 1)"),
                   (self.model is not None and Path(self.model).is_dir(),
                    f"model {self.model} (a Hugging Face directory; int4 needs a GGUF file "
                    f"with Q4_1 weights)")]
        for problem, what in refused:
            if problem:
                raise ConfigError(f"weight_format int4 does not support {what}")

    def engine_config(self, decodes: bool = True) -> EngineConfig:
        """``decodes``: the engine generates past the first token (decode role, colocated),
        so it runs speculative decoding if configured; prefill engines never do."""
        speculative = SpeculativeConfig(method=self.spec if decodes else "none", k=self.spec_k,
                                        draft_model=self.draft_model)
        return EngineConfig(speculative=speculative, device=self.engine_device(),
            model=self.model, dtype=self.engine_dtype()[0], block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, kv_cache_memory_gb=self.kv_cache_memory_gb,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_dtype=self.kv_cache_dtype, host_kv_cache_gb=self.host_kv_cache_gb,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_waiting=self.max_waiting,
            num_threads=self.engine_threads(), kernel_threads=self.engine_kernel_threads(),
            prefill_threads=self.engine_prefill_threads(),
            attention_backend=self.attention_backend,
            enable_prefix_caching=self.enable_prefix_caching,
            cuda_graphs=self.cuda_graphs, weight_format=self.weight_format,
            tensor_parallel_size=self.tensor_parallel_size, step_timeout_s=self.step_timeout_s)

    def served_model_names(self) -> tuple[str, ...]:
        """The model's names in the API (empty: its own id)."""
        names = self.served_model_name
        return (names,) if isinstance(names, str) else tuple(names or ())

    def cors_origins(self) -> tuple[str, ...]:
        """The origins browsers may call from (empty: none)."""
        origins = self.cors_allow_origins
        return (origins,) if isinstance(origins, str) else tuple(origins or ())

    def http_url(self) -> str:
        """Where the gateway's HTTP front end answers (https with TLS)."""
        return f"{'http' if self.tls_cert_file is None else 'https'}://{self.host}:{self.port}"

    def server_tls(self) -> ServerTLS | None:
        """The front ends' certificate and key, read and checked now (``TLSConfigError`` names
        the setting); None without TLS. The gateway calls it at start, where the files are."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return ServerTLS.read(self.tls_cert_file, self.tls_key_file)

    def internal_tls(self) -> InternalTLS | None:
        """The workers' mutual TLS, its files read and checked now (``TLSConfigError`` names
        the setting); None without it."""
        files = [getattr(self, name) for name in InternalTLS.SETTINGS]
        if None in files:
            return None
        return InternalTLS.read(*files)

    def _check_gateways(self) -> None:
        """Several gateway replicas: each on a node of its own, sharing what one keeps."""
        n = f"gateway_replicas {self.gateway_replicas}"
        if self.colocated:
            raise ConfigError(f"{n}: a colocated gateway is the engine; run one")
        if self.gateway_resource is None:
            raise ConfigError(f"{n} needs gateway_resource (one replica per node that declares "
                              f"it: each listens on that node's port {self.port})")
        if self.host not in WILDCARD_HOSTS:
            raise ConfigError(f"{n} needs host 0.0.0.0 (each replica listens on its own "
                              f"node's addresses), got {self.host!r}")
        if self.redis_url is None:
            raise ConfigError(f"{n} needs redis_url (the gateways share the router's prefix "
                              f"index and stored responses there)")

    def gateway_share(self, limit: int) -> int:
        """One gateway replica's part of a cluster-wide bound (``max_in_flight`` and its
        default): an equal share, rounded up."""
        return -(-limit // self.gateway_replicas)

    def in_flight_limit(self) -> int:
        """The cluster's admission bound (``max_in_flight`` or its default) at start-up, over
        every gateway replica; the default then follows the healthy decode workers
        (max_num_seqs each)."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return self.max_num_seqs * (1 if self.colocated else self.decode_replicas)

    def engine_threads(self) -> int:
        """``threads_per_worker``, or from the CPUs here: every engine rank of the shape on
        this machine gets an equal share, one CPU left for the gateway, Ray and the OS (a
        torch engine with as many threads as cores collapses when anything else runs). On
        Kubernetes each worker pod is its own machine: the chart sets the pod's CPUs."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        return max(1, (len(os.sched_getaffinity(0)) - 1) // self._engine_ranks())

    def engine_kernel_threads(self) -> int:
        """``kernel_threads``, or 2 where an engine has one torch thread (so our kernels run
        its projections) and the CPUs here give each engine rank two: the CPU
        ``engine_threads`` leaves to the gateway and Ray is the helper's when they are idle."""
        if self.kernel_threads is not None:
            return self.kernel_threads
        cpus = len(os.sched_getaffinity(0))
        return 2 if self.engine_threads() == 1 and cpus // self._engine_ranks() >= 2 else 1

    def engine_prefill_threads(self) -> int:
        """``prefill_threads``, or 2 where torch computes a float32 engine's projections on a
        CPU with one torch thread and the CPUs here give each engine rank two (the CPU
        ``engine_threads`` leaves to the gateway and Ray, which the kernels' helper takes in
        decode steps), else ``engine_threads``."""
        if self.prefill_threads is not None:
            return self.prefill_threads
        threads = self.engine_threads()
        cpus = len(os.sched_getaffinity(0))
        if (threads == 1 and cpus // self._engine_ranks() >= 2
                and self.engine_device() == "cpu" and self.engine_dtype()[0] == "float32"):
            return 2
        return threads

    def _engine_ranks(self) -> int:
        """Engine ranks of the shape on one machine."""
        tp = self.tensor_parallel_size
        return tp * (1 if self.colocated else self.prefill_replicas + self.decode_replicas)

    def engine_dtype(self) -> tuple[str, str]:
        """The engines' dtype and why it was chosen ("" when set): ``dtype``, or for auto
        (resolved where the engine is built) bfloat16 on a GPU and on a CPU where our kernels
        run, else float32."""
        if self.dtype != "auto":
            return self.dtype, ""
        if self.engine_device() == "cuda":
            return "bfloat16", "auto on a GPU"
        from tandem.services.engine import cpu_kernels

        reason = cpu_kernels.unavailable_reason()
        if reason is None:
            return "bfloat16", "auto: our bfloat16 CPU kernels run here"
        return "float32", f"auto: our bfloat16 CPU kernels cannot run here ({reason})"

    def engine_device(self) -> str:
        """Resolved where the engine is built (a GPU worker pod, not the machine that wrote
        the config)."""
        if self.device != "auto":
            return self.device
        import torch

        from tandem.services.engine.device import check_device

        if torch.cuda.is_available():
            return "cuda"
        if any(Path("/dev").glob("nvidia[0-9]*")):  # a GPU torch cannot use: say so, loudly
            check_device("cuda")
        return "cpu"

    def replace(self, **changes: Any) -> AppConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> AppConfig:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}; known: "
                              f"{', '.join(known)}")
        for name, value in data.items():
            _check_type(name, value, str(known[name].type), source)
        if data.get("attention_backend") == "flash_attn" and "block_size" not in data:
            data = {**data, "block_size": FLASH_ATTN_BLOCK_MULTIPLE}  # flash-attn's page size
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> AppConfig:
        """Settings from the file, then ``overrides`` (CLI flags that were given) on top."""
        return cls.from_dict({**read_yaml_settings(path), **overrides}, str(path))


def setting_comments() -> dict[str, str]:
    """Each AppConfig field's comment in this file (the lines above it and the one after it),
    the one description of each setting: the settings reference (``tandem settings``,
    docs/settings.md) prints them."""
    import ast
    import io
    import tokenize

    source = Path(__file__).read_text()
    lines = source.splitlines()
    comments, whole_line = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not lines[tok.start[0] - 1][:tok.start[1]].strip():
                whole_line.add(tok.start[0])
    cls = next(node for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef) and node.name == "AppConfig")
    found = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line in whole_line:
            above.insert(0, comments[line])
            line -= 1
        after = comments.get(node.lineno)
        found[node.target.id] = " ".join([*above, *([after] if after else [])])
    return found


def read_yaml_settings(path: str | Path) -> dict[str, Any]:
    """A config file's settings, unchecked (``AppConfig.from_dict`` checks them)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _at_least(name: str, value: float, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")


def _check_type(name: str, value: object, annotation: str, source: str) -> None:
    if value is None and "None" in annotation:
        return
    expected: tuple[type, ...] = ()
    if annotation.startswith("int"):
        expected = (int,)
    elif annotation.startswith("float"):
        expected = (int, float)
    elif annotation.startswith("bool"):
        expected = (bool,)
    elif annotation.startswith("str | list[str]"):
        expected = (str, list)
    elif annotation.startswith("str"):
        expected = (str,)
    if expected and (not isinstance(value, expected)
                     or (bool not in expected and isinstance(value, bool))):
        raise ConfigError(f"{source}: {name} must be {annotation}, got {value!r}")
