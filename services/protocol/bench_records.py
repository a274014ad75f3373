"""What one request did, as seen by the client. Times are seconds since the run's start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CUT_OFF = "cut off by the run's deadline"


@dataclass
class RequestRecord:
    index: int
    kind: str
    group: str
    prompt_tokens: int  # what the workload built (exact for the bench's tokenizer)
    start_s: float  # sent
    first_token_s: float | None = None  # first chunk carrying output
    end_s: float | None = None  # stream finished
    chunk_times_s: list[float] = field(default_factory=list)  # every chunk carrying output
    output_tokens: int = 0
    output_tokens_source: str = "none"  # usage | tokenizer | chunks
    server_prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str | None = None
    admitted: bool = False  # the server took it: HTTP 200, or a first gRPC message
    rejected: bool = False  # refused as overloaded before any work: HTTP 429 (gRPC: below)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None and self.end_s is not None

    @property
    def mid_stream_error(self) -> bool:
        """Admitted, then failed: an error event, a cut stream or a timeout after the 200."""
        return self.admitted and not self.ok

    @property
    def ttft(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.start_s

    @property
    def e2e(self) -> float:
        assert self.end_s is not None
        return self.end_s - self.start_s

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for a single output token."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def input_tokens(self) -> int:
        """The server's prompt count where it reported one, else the workload's."""
        return self.prompt_tokens if self.server_prompt_tokens is None else \
            self.server_prompt_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "kind": self.kind, "group": self.group,
            "prompt_tokens": self.prompt_tokens, "server_prompt_tokens": self.server_prompt_tokens,
            "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source, "error": self.error,
            "admitted": self.admitted, "rejected": self.rejected,
            "start_s": _round(self.start_s), "first_token_s": _round(self.first_token_s),
            "end_s": _round(self.end_s), "chunk_times_s": [_round(t) for t in self.chunk_times_s],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
