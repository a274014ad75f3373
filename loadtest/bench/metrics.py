"""Serving metrics with ``vllm bench serve``'s definitions.

Per successful request: TTFT = first output chunk - sent; E2E = end of stream - sent;
TPOT = (E2E - TTFT) / (output tokens - 1), left out for single-token outputs; ITL = gaps
between consecutive output chunks (pooled over requests). Throughputs divide by the run's
duration. A request is *good* when TTFT <= the TTFT SLO and TPOT <= the TPOT SLO (an SLO not
given always holds, and a single-token output passes the TPOT SLO, as in vLLM); goodput = good
requests per second. Percentiles interpolate linearly (numpy's default, as vLLM).

A request the server refuses as overloaded (HTTP 429, gRPC RESOURCE_EXHAUSTED with Retry-After)
is *rejected*, not failed; a request that fails after the server admitted it (an error event, a
cut stream) is a failure and a *mid-stream error*.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.services.protocol.bench_records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("--slo-ttft-ms", self.ttft_ms), ("--slo-tpot-ms", self.tpot_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value:g}")

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and record.ttft > self.ttft_ms / 1000.0:
            return False
        tpot = record.tpot
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms / 1000.0

    def describe(self) -> str:
        parts = [f"TTFT <= {self.ttft_ms:g} ms" if self.ttft_ms is not None else "",
                 f"TPOT <= {self.tpot_ms:g} ms" if self.tpot_ms is not None else ""]
        return " and ".join(p for p in parts if p) or "none (every completed request counts)"


@dataclass(frozen=True)
class Distribution:
    """Summary of a latency in milliseconds."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    percentiles: dict[str, float]  # "p50" -> value

    @property
    def p50(self) -> float:
        return self.percentiles["p50"]

    @property
    def p90(self) -> float:
        return self.percentiles["p90"]

    @property
    def p99(self) -> float:
        return self.percentiles["p99"]


def distribution(seconds: Sequence[float]) -> Distribution | None:
    if not seconds:
        return None
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return Distribution(
        count=int(ms.size), mean=float(ms.mean()), std=float(ms.std()), min=float(ms.min()),
        max=float(ms.max()),
        percentiles={f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES},
    )


@dataclass(frozen=True)
class Summary:
    requests: int  # sent or due
    completed: int
    failed: int  # not completed, rejections left out
    duration_s: float
    input_tokens: int  # over completed requests
    output_tokens: int
    cached_tokens: int | None  # prompt tokens the server served from its prefix cache
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    good_requests: int
    goodput: float  # good requests / s
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    prompt_token_mismatches: int  # server's prompt count != the workload's (tokenizer mismatch)
    errors: dict[str, int] = field(default_factory=dict)  # message -> count, of the failed
    rejected: int = 0  # refused as overloaded (HTTP 429) before any work: not failures
    mid_stream_errors: int = 0  # failed after the server admitted them (HTTP 200)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.cached_tokens is None or self.input_tokens == 0:
            return None
        return self.cached_tokens / self.input_tokens


def summarize(records: Iterable[RequestRecord], duration_s: float, slo: SLO,
              requests: int | None = None) -> Summary:
    records = list(records)
    done = [r for r in records if r.ok]
    tpots = [t for r in done if (t := r.tpot) is not None]
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    errors: dict[str, int] = {}
    rejected = sum(1 for r in records if r.rejected)
    for r in records:
        if not r.ok and not r.rejected:
            message = r.error or "incomplete"
            errors[message] = errors.get(message, 0) + 1
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r))
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        requests=len(records) if requests is None else requests,
        completed=len(done),
        failed=len(records) - len(done) - rejected,
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=sum(cached) if cached else None,
        request_throughput=len(done) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        good_requests=good,
        goodput=good * per_s,
        ttft=distribution([r.ttft for r in done]),
        tpot=distribution(tpots),
        itl=distribution([gap for r in done for gap in r.itls]),
        e2e=distribution([r.e2e for r in done]),
        prompt_token_mismatches=sum(1 for r in done if r.server_prompt_tokens is not None
                                    and r.server_prompt_tokens != r.prompt_tokens),
        errors=errors,
        rejected=rejected,
        mid_stream_errors=sum(1 for r in records if r.mid_stream_error),
    )
