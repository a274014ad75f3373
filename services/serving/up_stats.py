"""``tandem up``'s stats line: the gateway's own /metrics read every interval, one line (vLLM-like)
when something changed."""

from __future__ import annotations

import logging
import ssl
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.services.gateway.tenants import read_api_keys
from tandem.services.serving.config import AppConfig

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

log = logging.getLogger("tandem.up")


def client_context(config: AppConfig) -> ssl.SSLContext | None:
    # Trust the served certificate itself, not the name it carries, which is the service's,
    # not the loopback address polled here.
    return ca_context(config.tls_cert_file, check_hostname=False)


def ca_context(cafile: str | None, check_hostname: bool = True) -> ssl.SSLContext | None:
    """A client context trusting ``cafile`` (a CA, or the served certificate itself: a leaf
    will do, partial chain); None (the system's CAs) without one."""
    if cafile is None:
        return None
    context = ssl.create_default_context(cafile=cafile)
    context.check_hostname = check_hostname
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def read_text(url: str, headers: dict[str, str], context: ssl.SSLContext | None,
              timeout_s: float = 5.0) -> str:
    """The body of a GET; raises ``OSError`` (``urllib.error.HTTPError`` for a status >= 400)."""
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
        return str(response.read().decode())


def metric_samples(metrics_text: str) -> Iterator[Sample]:
    """Every sample of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        yield from family.samples


@dataclass(frozen=True)
class StatsSample:
    """What a stats line shows, from one read of the gateway's /metrics (summed over workers;
    the KV cache usage is the workers' mean)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    ended: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def stats_sample(metrics_text: str) -> StatsSample:
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for sample in metric_samples(metrics_text):
        total[sample.name] = total.get(sample.name, 0.0) + sample.value
        count[sample.name] = count.get(sample.name, 0) + 1
    kv = "tandem_kv_cache_usage_perc"
    return StatsSample(running=int(total.get("tandem_num_requests_running", 0)),
                       waiting=int(total.get("tandem_num_requests_waiting", 0)),
                       kv_usage=total.get(kv, 0.0) / count[kv] if count.get(kv) else 0.0,
                       ended=int(total.get("tandem_request_success_total", 0)),
                       prompt_tokens=int(total.get("tandem_prompt_tokens_total", 0)),
                       generation_tokens=int(total.get("tandem_generation_tokens_total", 0)),
                       prefix_queries=total.get("tandem_prefix_cache_queries_total", 0.0),
                       prefix_hits=total.get("tandem_prefix_cache_hits_total", 0.0))


def stats_line(now: StatsSample, before: StatsSample, elapsed_s: float) -> str:
    """One line, vLLM-like: rates over the interval since ``before``, then the totals."""
    seconds = max(elapsed_s, 1e-9)
    queries = now.prefix_queries - before.prefix_queries
    hit_rate = (f"{100 * (now.prefix_hits - before.prefix_hits) / queries:.1f}%" if queries > 0
                else "-")
    return (f"stats: {now.running} running, {now.waiting} waiting | "
            f"prompt {(now.prompt_tokens - before.prompt_tokens) / seconds:.1f} tok/s, "
            f"generation {(now.generation_tokens - before.generation_tokens) / seconds:.1f} "
            f"tok/s | KV cache {100 * now.kv_usage:.1f}% | prefix cache hit rate {hit_rate} | "
            f"{now.ended} requests ended: {now.prompt_tokens} prompt, "
            f"{now.generation_tokens} generated tokens")


def kv_capacity(config: AppConfig, timeout_s: float = 5.0) -> tuple[int, int] | None:
    """The served context (max_model_len) and the fewest tokens any engine's KV cache holds,
    from the gateway's /v1/models and /metrics; None when they cannot be read."""
    import json

    key = next(iter(read_api_keys(config.api_keys_file)), None) if config.api_keys_file else None
    context = client_context(config)
    try:
        models = json.loads(read_text(f"{config.http_url()}/v1/models", bearer(key), context,
                                      timeout_s))
        metrics = read_text(f"{config.http_url()}/metrics", bearer(key), context, timeout_s)
    except (OSError, ValueError) as exc:
        log.debug("KV capacity: %s", exc)
        return None
    tokens = [int(s.value) for s in metric_samples(metrics)
              if s.name == "tandem_kv_cache_capacity_tokens" and s.value > 0]
    if not tokens or not models.get("data"):
        return None
    return int(models["data"][0]["max_model_len"]), min(tokens)


class StatsReporter:
    """Reads the gateway's /metrics (with the first API key when metrics need one); a line
    when anything changed since the previous read, none while idle."""

    def __init__(self, config: AppConfig) -> None:
        self.url = f"{config.http_url()}/metrics"
        self.context = client_context(config)
        self.headers: dict[str, str] = {}
        if config.metrics_require_key and config.api_keys_file:
            self.headers = bearer(next(iter(read_api_keys(config.api_keys_file))))
        self.last = StatsSample()  # every counter starts at zero with the gateway
        self.last_time = time.monotonic()

    def poll(self) -> str | None:
        try:
            text = read_text(self.url, self.headers, self.context)
        except OSError as exc:  # the gateway busy or restarting: the next interval will tell
            log.debug("stats: %s: %s", self.url, exc)
            return None
        now, sample = time.monotonic(), stats_sample(text)
        line = None if sample == self.last else stats_line(sample, self.last,
                                                           now - self.last_time)
        self.last, self.last_time = sample, now
        return line
