"""Tandem's service-level objectives: the targets the dashboards draw and the alert rules guard.

Change a target here and regenerate (``python -m deploy.grafana``). Latency thresholds must be
bucket bounds of their histogram (a test checks it): a ratio such as "requests with TTFT <= 1 s"
is read off the bucket ``le="1.0"``, and a bound the histogram lacks selects nothing. On the
dashboards the targets are variables whose choices are those bounds, defaulting to these.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from tandem.services.gateway.metrics import (
    E2E_BUCKETS,
    GOODPUT_TPOT_LIMITS,
    GOODPUT_TTFT_LIMITS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
)


@dataclass(frozen=True)
class LatencySlo:
    key: str  # short name: dashboard variable "<key>_target", alert names
    title: str
    metric: str  # histogram family
    buckets: tuple[float, ...]  # the histogram's bucket bounds
    choices: tuple[float, ...]  # the dashboard variable's choices (bucket bounds)
    threshold_s: float  # the default target
    objective: float  # share of events within the threshold, e.g. 0.99
    events: str  # what the objective counts

    @property
    def le(self) -> str:
        """The threshold as Prometheus writes a bucket bound."""
        return floatToGoString(self.threshold_s)

    @property
    def variable(self) -> str:
        return f"{self.key}_target"


TTFT = LatencySlo("ttft", "Time to first token", "tandem_time_to_first_token_seconds",
                  TTFT_BUCKETS, GOODPUT_TTFT_LIMITS, 1.0, 0.99, "requests")
ITL = LatencySlo("itl", "Inter-token latency", "tandem_inter_token_latency_seconds",
                 ITL_BUCKETS, (0.025, 0.05, 0.1, 0.2, 0.5), 0.1, 0.99, "tokens")
# Per request: (E2E - TTFT) / (output tokens - 1); with TTFT it defines goodput.
TPOT = LatencySlo("tpot", "Time per output token", "tandem_request_time_per_output_token_seconds",
                  ITL_BUCKETS, GOODPUT_TPOT_LIMITS, 0.1, 0.99, "requests")
# E2E grows with the output length, so it has a target line but no alert.
E2E = LatencySlo("e2e", "End-to-end latency", "tandem_e2e_request_latency_seconds",
                 E2E_BUCKETS, (5.0, 10.0, 20.0, 30.0, 60.0, 120.0), 30.0, 0.99, "requests")

LATENCY_SLOS = (TTFT, ITL, TPOT, E2E)
ALERTED_LATENCY_SLOS = (TTFT, ITL)

# Requests that fail inside Tandem (tandem_request_failures_total with one of SERVER_ERRORS as
# reason, the 5xx answers) over all requests; rejections (429) and invalid requests (400) are
# the client's signal, not an outage.
AVAILABILITY_OBJECTIVE = 0.999
SERVER_ERRORS = ("error", "engine_error", "timeout", "unavailable")
# Goodput (requests within both the TTFT and the TPOT target) over finished requests.
GOODPUT_OBJECTIVE = 0.95
# Rejected (429) share that a dashboard paints red: the cluster is too small for its load.
REJECTION_WARN = 0.01
# KV cache usage that a dashboard paints red and that warns after 10 minutes: preemptions
# (recomputes) are near.
KV_USAGE_WARN = 0.9
# Admitted requests over the gateway's admission bound that warns: 429s are near.
IN_FLIGHT_WARN = 0.9
# Rejected (429) share that warns: the cluster sheds load.
SHEDDING_WARN = 0.05
# Timed-out (504) share that warns.
TIMEOUT_WARN = 0.01
# Share of the router's prefill choices made without its prefix index that warns.
FALLBACK_WARN = 0.5
# Speculative acceptance rate that a dashboard paints red: most verification work is wasted,
# and decoding without drafts may be faster.
SPEC_ACCEPTANCE_WARN = 0.3


@dataclass(frozen=True)
class BurnWindow:
    """One multi-window burn-rate alert (the Google SRE workbook's scheme): it fires when the
    error budget burns ``factor`` times too fast over both windows; the short one makes it stop
    soon after the burning does."""

    long: str
    short: str
    factor: float
    severity: str


BURN_WINDOWS = (
    BurnWindow("1h", "5m", 14.4, "page"),  # 2% of a 30-day budget in an hour
    BurnWindow("6h", "30m", 6.0, "page"),  # 5% in six hours
    BurnWindow("1d", "2h", 3.0, "ticket"),  # 10% in a day
    BurnWindow("3d", "6h", 1.0, "ticket"),  # 10% in three days
)
