"""Targets (where to send) and the client interface both protocols implement."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import urlsplit

from tandem.loadtest.bench.workloads import BenchRequest, Endpoint
from tandem.services.protocol.bench_records import RequestRecord

WireProtocol = Literal["http", "grpc"]
PREFLIGHT_TIMEOUT_S = 5.0


class TargetError(Exception):
    """The target cannot be used: unreachable, rejects our key, or names no model."""


@dataclass(frozen=True)
class Target:
    label: str
    protocol: WireProtocol
    address: str  # http: the OpenAI base URL ending in /v1; grpc: host:port

    @classmethod
    def parse(cls, spec: str, protocol: WireProtocol | None = None) -> Target:
        """``URL`` or ``LABEL=URL``; URLs: http(s)://host:port[/v1] or grpc://host:port (or
        host:port with protocol grpc)."""
        label, sep, url = spec.partition("=")
        if not sep or "://" in label:
            label, url = "", spec
        scheme = urlsplit(url).scheme if "://" in url else ""
        if protocol is None:
            protocol = "grpc" if scheme == "grpc" else "http"
        if protocol == "grpc":
            address = url.split("://", 1)[-1].rstrip("/")
            host, _, port = address.rpartition(":")
            if scheme not in ("", "grpc") or not host or not port.isdigit():
                raise ValueError(f"a gRPC target is grpc://HOST:PORT or HOST:PORT, got {url!r}")
            default_label = address
        else:
            parts = urlsplit(url)
            if scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"an HTTP target is http(s)://HOST:PORT[/v1], got {url!r}")
            path = parts.path.rstrip("/")
            path = path if path.endswith("/v1") else f"{path}/v1"
            address = f"{parts.scheme}://{parts.netloc}{path}"
            default_label = parts.netloc
        return cls(label or default_label, protocol, address)


@dataclass(frozen=True)
class ClientOptions:
    endpoint: Endpoint = "completions"
    model: str | None = None  # None: ask the server
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 300.0
    # Counts output tokens from the text when the server sends no usage.
    count_tokens: Callable[[str], int] | None = None


class Client(Protocol):
    async def preflight(self) -> str:
        """Check the target answers; return the model name to send (asking the server if need
        be). Raises TargetError."""
        ...

    async def send(self, request: BenchRequest, origin: float) -> RequestRecord:
        """Stream one request; never raises for the request's own failures (they are recorded)."""
        ...

    async def aclose(self) -> None: ...


def finish_output_count(record: RequestRecord, usage_tokens: int | None, text: str,
                        options: ClientOptions) -> None:
    """Output tokens from the server's usage, else counted from the text, else the chunks."""
    if usage_tokens is not None:
        record.output_tokens, record.output_tokens_source = usage_tokens, "usage"
    elif options.count_tokens is not None:
        record.output_tokens = options.count_tokens(text)
        record.output_tokens_source = "tokenizer"
    else:
        record.output_tokens, record.output_tokens_source = len(record.chunk_times_s), "chunks"
