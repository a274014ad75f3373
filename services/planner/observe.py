"""The live load from the gateway's /metrics: two reads ``window`` seconds apart (or two saved
/metrics texts), read with the reader ``tandem status`` uses.

Over the window: arrival rate λ = Δ(requests ended + failed) / window; mean prompt and output
tokens per ended request from Δtandem_prompt_tokens and Δtandem_generation_tokens; the prefix
hit rate from the prefill workers' Δhits / Δqueries (every worker's on a colocated cluster).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.services.planner.sizing import Load
from tandem.services.serving.status import metric_series
from tandem.services.serving.up_stats import bearer, ca_context, read_text

ENDED = "tandem_request_success_total"
FAILED = "tandem_request_failures_total"


class NotPrometheus(ValueError):
    """A /metrics text that does not parse as Prometheus' exposition format."""


class NoTraffic(ValueError):
    """No request ended in the window: the token means are unknown."""


@dataclass(frozen=True)
class Counters:
    """The totals the planner needs from one /metrics read."""

    ended: float
    failed: float
    prompt_tokens: float
    generation_tokens: float
    prefix_queries: float
    prefix_hits: float
    roles: frozenset[str]  # the workers' roles ("prefill", "decode"; none when colocated)


def counters(metrics_text: str) -> Counters:
    try:
        values, roles, _ = metric_series(metrics_text)
    except ValueError as exc:
        raise NotPrometheus(f"not Prometheus text ({exc})") from None
    prefill = {w for w, role in roles.items() if role == "prefill"}

    def total(name: str, workers: set[str] | None = None) -> float:
        by_worker = values.get(name, {})
        return sum(v for w, v in by_worker.items() if workers is None or w in workers)

    cache_workers = prefill or None
    return Counters(ended=total(ENDED), failed=total(FAILED),
                    prompt_tokens=total("tandem_prompt_tokens_total"),
                    generation_tokens=total("tandem_generation_tokens_total"),
                    prefix_queries=total("tandem_prefix_cache_queries_total", cache_workers),
                    prefix_hits=total("tandem_prefix_cache_hits_total", cache_workers),
                    roles=frozenset(r for r in roles.values() if r))


def load_between(before: str, after: str, window_s: float) -> Load:
    """The load over ``window_s`` seconds between two /metrics texts."""
    if not window_s > 0:
        raise ValueError(f"the window must be > 0 s, got {window_s:g}")
    a, b = counters(before), counters(after)
    if "prefill" not in b.roles:
        raise ValueError("the gateway reports no prefill workers: a colocated cluster (or none "
                         "started); the planner sizes disaggregated prefill and decode pools")
    ended = b.ended - a.ended
    arrived = ended + b.failed - a.failed
    if ended <= 0:
        raise NoTraffic(f"no request ended in the {window_s:g} s window: nothing to size from "
                        f"(a longer --window, or traffic)")
    queries = b.prefix_queries - a.prefix_queries
    hit_rate = (b.prefix_hits - a.prefix_hits) / queries if queries > 0 else 0.0
    return Load(rate=arrived / window_s,
                prompt_tokens=(b.prompt_tokens - a.prompt_tokens) / ended,
                output_tokens=(b.generation_tokens - a.generation_tokens) / ended,
                hit_rate=min(1.0, max(0.0, hit_rate)))


def observe(url: str, window_s: float, api_key: str | None = None, cacert: str | None = None,
            wait: Callable[[float], None] = time.sleep, timeout_s: float = 5.0) -> Load:
    """Read the gateway's /metrics, wait ``window_s``, read again: the load in between."""
    metrics_url = f"{url.rstrip('/')}/metrics"
    headers, context = bearer(api_key), ca_context(cacert)
    before = read_text(metrics_url, headers, context, timeout_s)
    started = time.monotonic()
    wait(window_s)
    after = read_text(metrics_url, headers, context, timeout_s)
    return load_between(before, after, time.monotonic() - started)
