"""Gateway settings, shared by the HTTP and gRPC front ends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    # The model's names in the API (a request may name any; responses carry the first);
    # empty: the backend's model id
    served_model_names: tuple[str, ...] = ()
    seed: int | None = None  # sampled requests without a seed get one drawn from this; None: random
    metrics_require_key: bool = False  # /metrics needs an API key too (/health never does)
    max_body_bytes: int = MIB  # larger request bodies get 413 (gRPC: RESOURCE_EXHAUSTED)
    default_max_tokens: int | None = None  # cap when a request sets none; None: context length
    retry_after_s: int = 1  # Retry-After on 429
    worker_name: str = "colocated"  # the `worker` label of a single-engine backend's stats
    request_timeout_s: float | None = 600.0  # the longest a request may take (504 after)
    max_in_flight: int | None = None  # requests admitted at once; beyond: 429. None: no bound
    # One tenant's requests in flight, at most (tenants.FairSlots.cap); None: with several
    # tenants, max_in_flight less a quarter
    tenant_max_in_flight: int | None = None
    # A streaming client that reads nothing for this long (its connection's buffers full) is
    # cut: its request aborted, its connection dropped. None: never.
    client_read_timeout_s: float | None = 60.0
    # Connections (HTTP): a request's headers must arrive within header_timeout_s of the
    # connection's opening or of its first byte, its body within body_timeout_s of its headers
    # (else 408 and the connection closed); beyond max_connections, 503. gRPC: at most
    # max_grpc_streams calls at once (beyond: RESOURCE_EXHAUSTED).
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    max_grpc_streams: int = 1024
    # A non-streaming response is built whole in memory: at most this many token entries
    # (choices x max_tokens x (1 + logprobs), plus the prompt's logprobs); beyond, 400 (stream it)
    max_buffered_tokens: int = 1 << 18
    # Sampling settings for requests that leave them unset (the model's generation_config.json:
    # ModelMetadata.sampling_defaults): SamplingOptions field -> value.
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)
    # Origins whose browser pages may call the HTTP API (CORS); empty: none ("*": any).
    cors_allow_origins: tuple[str, ...] = ()
    # Chat replies' reasoning apart (gateway/reasoning.py): auto, think (or vLLM's deepseek_r1,
    # qwen3), none
    reasoning_parser: str = "auto"
    # How replies under tool_choice auto write tool calls (gateway/tool_parsers.py): auto (the
    # chat template's format), hermes, mistral, llama3_json, pythonic, qwen3_coder
    tool_call_parser: str = "auto"
    # /v1/responses' stored responses in this Redis (every gateway replica sees them, a restart
    # keeps them); None: in the gateway's process (responses_api.py)
    responses_redis_url: str | None = field(default=None, repr=False)  # may hold a password

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "max_grpc_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        for name in ("max_in_flight", "tenant_max_in_flight"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.client_read_timeout_s is not None and not self.client_read_timeout_s > 0:
            raise ValueError(f"client_read_timeout_s must be > 0, got {self.client_read_timeout_s}")
