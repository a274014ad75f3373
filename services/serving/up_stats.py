"""``tandem up``'s stats line: the gateway's own /metrics read every interval, one line (vLLM-like)
when something changed."""

from __future__ import annotations

import logging
import ssl
import time
import urllib.request
from dataclasses import dataclass

from services.gateway.tenants import read_api_keys
from services.serving.config import AppConfig

log = logging.getLogger("tandem.up")


def client_context(config: AppConfig) -> ssl.SSLContext | None:
    if config.tls_cert_file is None:
        return None
    # Trust the served certificate itself (a leaf will do: partial chain), not the name it
    # carries, which is the service's, not the loopback address polled here.
    context = ssl.create_default_context(cafile=config.tls_cert_file)
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


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
    from prometheus_client.parser import text_string_to_metric_families

    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
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


class StatsReporter:
    """Reads the gateway's /metrics (with the first API key when metrics need one); a line
    when anything changed since the previous read, none while idle."""

    def __init__(self, config: AppConfig) -> None:
        self.url = f"{config.http_url()}/metrics"
        self.context = client_context(config)
        self.headers: dict[str, str] = {}
        if config.metrics_require_key and config.api_keys_file:
            first_key = next(iter(read_api_keys(config.api_keys_file)))
            self.headers["Authorization"] = f"Bearer {first_key}"
        self.last = StatsSample()  # every counter starts at zero with the gateway
        self.last_time = time.monotonic()

    def poll(self) -> str | None:
        request = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.context) as response:
                text = response.read().decode()
        except OSError as exc:  # the gateway busy or restarting: the next interval will tell
            log.debug("stats: %s: %s", self.url, exc)
            return None
        now, sample = time.monotonic(), stats_sample(text)
        line = None if sample == self.last else stats_line(sample, self.last,
                                                           now - self.last_time)
        self.last, self.last_time = sample, now
        return line
