"""Prometheus metrics for one gateway app, in its own registry (several apps share a process).

Latency and token metrics are measured by the gateway per request; engine gauges and prefix-cache
counters are read from the backend's stats at scrape time, one series per worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tandem.services.gateway.errors import GatewayError
from tandem.services.protocol.outputs import EngineStats, FinishReason
from tandem.services.protocol.request import DEFAULT_TENANT, UNKNOWN_TENANT

# vLLM's buckets, so dashboards and SLO queries carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = ITL_BUCKETS

# Goodput needs TTFT and TPOT of the same request, which two histograms cannot tell. A finished
# request counts in every cell (ttft_le, tpot_le) of this grid whose limits it meets, so the
# goodput for any pair of targets on the grid is one counter series. The limits are bucket
# bounds of the TTFT and TPOT histograms, so one target reads the same in every panel.
GOODPUT_TTFT_LIMITS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GOODPUT_TPOT_LIMITS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5)

# Reasons of tandem_request_failures_total.
REJECTED = "rejected"  # overloaded (the gateway's or a worker's bound): 429 with Retry-After
# Refused as invalid: bad JSON or a bad field (400), an unknown model (404), a body over the
# limit (413), by the gateway's checks or by the backend.
INVALID = "invalid"
UNAUTHENTICATED = "unauthenticated"  # API keys are on and its key is missing or wrong: 401
TIMEOUT = "timeout"  # its deadline (or a hop's timeout) passed: 504
ENGINE_ERROR = "engine_error"  # a worker's engine failed while running it: 500
UNAVAILABLE = "unavailable"  # no healthy worker could take it: 503 with Retry-After
SLOW_CLIENT = "slow_client"  # the client read nothing for client_read_timeout_s: cut
ERROR = "error"  # anything else: the request failed inside Tandem
FAILURE_REASONS = (REJECTED, INVALID, UNAUTHENTICATED, TIMEOUT, ENGINE_ERROR, UNAVAILABLE,
                   SLOW_CLIENT, ERROR)
_REASON_BY_STATUS = {429: REJECTED, 401: UNAUTHENTICATED, 504: TIMEOUT, 500: ENGINE_ERROR,
                     503: UNAVAILABLE}  # any other 4xx: INVALID

StatsSource = Callable[[], Mapping[str, EngineStats]]


class GatewayMetrics:
    def __init__(self, model_name: str, stats_source: StatsSource,
                 registry: CollectorRegistry | None = None,
                 tenants: Sequence[str] = (DEFAULT_TENANT,), authenticates: bool = False
                 ) -> None:
        """``tenants``: the request metrics' ``tenant`` label values known at start;
        ``authenticates``: API keys are checked, so refusals may count for ``UNKNOWN_TENANT``."""
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        # The gateway process' own: process_resident_memory_bytes, process_cpu_seconds_total,
        # process_open_fds, ... (Prometheus' standard names)
        ProcessCollector(registry=self.registry)
        gauges = ["model_name"]
        labels = ["model_name", "tenant"]  # per request: whose API key sent it
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("tandem_inter_token_latency_seconds",
                             "Time between generated tokens (a step's gap split over its tokens).",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds",
                             "Time from request arrival to its end.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)
        self.success = Counter("tandem_request_success", "Requests that ended, by reason.",
                               [*labels, "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of ended requests.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("tandem_generation_tokens",
                                         "Tokens generated (and sent) by ended requests.",
                                         labels, registry=self.registry)
        self.tpot = Histogram("tandem_request_time_per_output_token_seconds",
                              "Per finished request: (E2E - TTFT) / (output tokens - 1).",
                              labels, buckets=TPOT_BUCKETS, registry=self.registry)
        self.within_slo = Counter("tandem_request_within_slo",
                                  "Finished requests (stop or length) whose TTFT <= ttft_le and "
                                  "TPOT <= tpot_le (goodput).",
                                  [*labels, "ttft_le", "tpot_le"], registry=self.registry)
        self.failures = Counter("tandem_request_failures",
                                "Requests that failed: rejected (overloaded, 429), invalid "
                                "(bad JSON or field, unknown model, body too large: 400, 404, "
                                "413), unauthenticated (missing or wrong API key, 401; tenant "
                                "unknown), timeout (deadline, 504), "
                                "engine_error (a worker's engine failed, 500), unavailable "
                                "(no healthy worker, 503), slow_client (read nothing for "
                                "client_read_timeout_s: cut), error (internal).",
                                [*labels, "reason"], registry=self.registry)
        self.connections_cut = Counter("tandem_http_connections_cut",
                                       "HTTP connections closed for not sending a request's "
                                       "headers (header_timeout) or body (body_timeout) in "
                                       "time.", [*gauges, "reason"], registry=self.registry)
        for reason in ("header_timeout", "body_timeout"):
            self.connections_cut.labels(model_name, reason)
        self.store_failures = Counter("tandem_responses_store_failures",
                                      "Responses (/v1/responses, store: true) answered but "
                                      "not stored: the store (Redis) did not answer.", gauges,
                                      registry=self.registry)
        self.store_failures.labels(model_name)
        self.in_flight = Gauge("tandem_requests_in_flight",
                               "Requests the gateway admitted that have not ended.", gauges,
                               registry=self.registry)
        self.in_flight_limit = Gauge("tandem_requests_in_flight_limit",
                                     "The gateway's admission bound (beyond it: 429); 0 = none.",
                                     gauges, registry=self.registry)
        self.in_flight.labels(model_name)
        self.in_flight_limit.labels(model_name)
        # Every series from the start, so that rate() sees the first request of each.
        for tenant in tenants:
            for ttft_le, tpot_le in goodput_cells():
                self.within_slo.labels(model_name, tenant, ttft_le, tpot_le)
            for reason in FAILURE_REASONS:
                self.failures.labels(model_name, tenant, reason)
            for finish in FinishReason:
                self.success.labels(model_name, tenant, str(finish))
        if authenticates:
            for reason in (INVALID, UNAUTHENTICATED):
                self.failures.labels(model_name, UNKNOWN_TENANT, reason)
        self.registry.register(_EngineStatsCollector(model_name, stats_source))

    def start_request(self, arrival_time: float | None = None, tenant: str = DEFAULT_TENANT
                      ) -> RequestTimer:
        return RequestTimer(self, time.monotonic() if arrival_time is None else arrival_time,
                            tenant)

    def fail(self, tenant: str, reason: str) -> None:
        """Count one failed request (``reason``: one of ``FAILURE_REASONS``)."""
        self.failures.labels(self.model_name, tenant, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def failure_reason(error: GatewayError) -> str:
    """The ``reason`` label for a request that failed with ``error``."""
    if error.status == 500 and error.code != "engine_error":
        return ERROR
    return _REASON_BY_STATUS.get(error.status, INVALID if 400 <= error.status < 500 else ERROR)


def goodput_cells(ttft: float = 0.0, tpot: float = 0.0) -> list[tuple[str, str]]:
    """(ttft_le, tpot_le) label values, as Prometheus writes bounds, of the goodput cells that a
    request with this TTFT and TPOT meets (by default all of them)."""
    return [(floatToGoString(t), floatToGoString(p))
            for t in GOODPUT_TTFT_LIMITS if ttft <= t for p in GOODPUT_TPOT_LIMITS if tpot <= p]


@dataclass
class RequestTimer:
    metrics: GatewayMetrics
    arrival_time: float  # time.monotonic()
    tenant: str = DEFAULT_TENANT
    first_token_time: float | None = None
    last_token_time: float | None = None
    ended: bool = field(default=False)

    def tokens(self, count: int, now: float | None = None) -> None:
        """``count`` tokens arrived together (one engine step)."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        name = self.metrics.model_name
        if self.last_token_time is None:
            self.metrics.ttft.labels(name, self.tenant).observe(now - self.arrival_time)
            self.first_token_time = now
            count -= 1
        else:
            gap = (now - self.last_token_time) / count
            for _ in range(count):
                self.metrics.itl.labels(name, self.tenant).observe(gap)
        self.last_token_time = now

    def end(self, finished_reason: str, prompt_tokens: int, generation_tokens: int,
            now: float | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        name = self.metrics.model_name
        now = time.monotonic() if now is None else now
        self.metrics.e2e.labels(name, self.tenant).observe(now - self.arrival_time)
        self.metrics.success.labels(name, self.tenant, finished_reason).inc()
        self.metrics.prompt_tokens.labels(name, self.tenant).inc(prompt_tokens)
        self.metrics.generation_tokens.labels(name, self.tenant).inc(generation_tokens)
        if finished_reason == "abort" or self.first_token_time is None:
            return
        ttft = self.first_token_time - self.arrival_time
        tpot = 0.0  # a single token has no gaps, so it meets any TPOT target (as vLLM counts it)
        if generation_tokens > 1:
            tpot = (now - self.first_token_time) / (generation_tokens - 1)
            self.metrics.tpot.labels(name, self.tenant).observe(tpot)
        for ttft_le, tpot_le in goodput_cells(ttft, tpot):
            self.metrics.within_slo.labels(name, self.tenant, ttft_le, tpot_le).inc()

    def fail(self, reason: str) -> None:
        """The request failed (one of ``FAILURE_REASONS``); it counts here, not as ended."""
        if self.ended:
            return
        self.ended = True
        self.metrics.fail(self.tenant, reason)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, source: StatsSource) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker"]
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily,
                             Callable[[EngineStats], float]]] = [
            (GaugeMetricFamily("tandem_num_requests_running",
                               "Requests in the running batch.", labels=labels),
             lambda s: s.num_running),
            (GaugeMetricFamily("tandem_num_requests_waiting", "Requests waiting to be scheduled.",
                               labels=labels), lambda s: s.num_waiting),
            (GaugeMetricFamily("tandem_kv_cache_usage_perc",
                               "Fraction of KV blocks in use (1 = full).", labels=labels),
             lambda s: s.kv_cache_usage),
            (CounterMetricFamily("tandem_prefix_cache_queries",
                                 "Prompt tokens looked up in the prefix cache.", labels=labels),
             lambda s: s.prefix_cache_queries),
            (CounterMetricFamily("tandem_prefix_cache_hits",
                                 "Prompt tokens found in the prefix cache.", labels=labels),
             lambda s: s.prefix_cache_hits),
            (CounterMetricFamily("tandem_host_kv_restored_blocks",
                                 "KV blocks copied back from the host-memory tier (host-tier "
                                 "prefix hits, not recomputed).", labels=labels),
             lambda s: s.host_kv_restored_blocks),
            (CounterMetricFamily("tandem_host_kv_offloaded_blocks",
                                 "Evicted prefix-cache KV blocks copied to the host-memory tier.",
                                 labels=labels), lambda s: s.host_kv_offloaded_blocks),
            (GaugeMetricFamily("tandem_host_kv_usage_perc",
                               "Fraction of the host-memory KV tier's blocks in use (0 when off).",
                               labels=labels),
             lambda s: s.host_kv_blocks / s.host_kv_capacity_blocks
             if s.host_kv_capacity_blocks else 0.0),
            (CounterMetricFamily("tandem_num_preemptions", "Sequences preempted (recomputed).",
                                 labels=labels), lambda s: s.num_preemptions),
            (CounterMetricFamily("tandem_spec_decode_draft_tokens",
                                 "Speculative draft tokens the target model verified.",
                                 labels=labels), lambda s: s.spec_draft_tokens),
            (CounterMetricFamily("tandem_spec_decode_accepted_tokens",
                                 "Speculative draft tokens accepted.", labels=labels),
             lambda s: s.spec_accepted_tokens),
            (CounterMetricFamily("tandem_spec_decode_steps",
                                 "Verification steps (per sequence) with at least one draft "
                                 "token; accepted/steps is the mean accepted length.",
                                 labels=labels), lambda s: s.spec_steps),
        ]
        stats = self._source()
        for family, value in families:
            for worker, worker_stats in stats.items():
                family.add_metric([self._model_name, worker], float(value(worker_stats)))
            yield family
