"""Tandem's prefix-cache counters from the server's Prometheus ``/metrics``, per worker role.

The client's hit rate (``usage.prompt_tokens_details.cached_tokens``) is what the serving
worker reported for each request; these counters are the engines' own, so a run's hit rate on
the server side is the difference of two scrapes, taken before and after the run. Counters
come per worker (label ``worker``); the role comes from ``tandem_kv_cache_blocks``, which
carries both labels (``colocated`` for a single engine in the gateway).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

HITS = "tandem_prefix_cache_hits"
QUERIES = "tandem_prefix_cache_queries"
ROLES = "tandem_kv_cache_blocks"
UNKNOWN_ROLE = "unknown"


@dataclass(frozen=True)
class CacheCounters:
    """Prompt tokens looked up in the prefix cache, and those found (vLLM's definition)."""

    queries: float = 0.0
    hits: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries + other.queries, self.hits + other.hits)

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries - other.queries, self.hits - other.hits)


RoleCounters = dict[str, CacheCounters]  # worker role -> counters summed over its workers


def parse_cache_counters(text: str) -> RoleCounters:
    """Sum the prefix-cache counters of a Prometheus text page by worker role."""
    per_worker: dict[str, dict[str, float]] = {}
    roles: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (HITS, QUERIES, ROLES):
            continue
        for sample in family.samples:
            worker = sample.labels.get("worker")
            if worker is None:
                continue
            if family.name == ROLES:
                roles[worker] = sample.labels.get("role", UNKNOWN_ROLE)
            else:
                per_worker.setdefault(worker, {})[family.name] = sample.value
    totals: RoleCounters = {}
    for worker, values in sorted(per_worker.items()):
        role = roles.get(worker, UNKNOWN_ROLE)
        totals[role] = totals.get(role, CacheCounters()) + CacheCounters(
            values.get(QUERIES, 0.0), values.get(HITS, 0.0))
    return totals


def difference(after: Mapping[str, CacheCounters], before: Mapping[str, CacheCounters]
               ) -> RoleCounters:
    return {role: counters - before.get(role, CacheCounters())
            for role, counters in sorted(after.items())}


def add(a: Mapping[str, CacheCounters], b: Mapping[str, CacheCounters]) -> RoleCounters:
    return {role: a.get(role, CacheCounters()) + b.get(role, CacheCounters())
            for role in sorted(a.keys() | b.keys())}


def metrics_url(base_url: str) -> str:
    """``/metrics`` beside the OpenAI base URL (``http://host:port/v1`` -> ``.../metrics``)."""
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    return f"{root}/metrics"


class CacheProbe:
    """Scrapes one or more servers' counters, waiting until they have settled: a
    disaggregated gateway learns its workers' counters from periodic status polls, so a scrape
    taken right after a run can lag by one poll interval."""

    def __init__(self, urls: Mapping[str, str], settle_s: float = 1.0,
                 timeout_s: float = 20.0) -> None:
        self._urls = dict(urls)  # target label -> metrics URL
        self._settle_s = settle_s
        self._timeout_s = timeout_s
        self._client = httpx.AsyncClient(timeout=10.0)

    async def scrape(self, label: str) -> RoleCounters:
        response = await self._client.get(self._urls[label])
        response.raise_for_status()
        return parse_cache_counters(response.text)

    async def settled(self, label: str) -> RoleCounters:
        """Scrape until two scrapes ``settle_s`` apart agree (or the timeout passes, returning
        the last)."""
        deadline = time.monotonic() + self._timeout_s
        last = await self.scrape(label)
        while time.monotonic() < deadline:
            await asyncio.sleep(self._settle_s)
            current = await self.scrape(label)
            if current == last:
                break
            last = current
        return last

    async def aclose(self) -> None:
        await self._client.aclose()
