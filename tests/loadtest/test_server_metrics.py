"""Prefix-cache counters read back from the gateway's real Prometheus exposition."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest

from tandem.loadtest.bench.server_metrics import (
    CacheCounters,
    add,
    difference,
    metrics_url,
    parse_cache_counters,
)
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.protocol.outputs import EngineStats
from tandem.services.serving import metrics as worker_metrics
from tandem.services.serving.cluster_view import WorkerSnapshot


def stats(queries: int, hits: int) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_free_blocks=10, num_blocks=10,
                       kv_cache_usage=0.0, prefix_cache_queries=queries,
                       prefix_cache_hits=hits, num_preemptions=0)


def test_counters_are_summed_per_worker_role() -> None:
    snapshots = [WorkerSnapshot("prefill#a", "prefill", stats(1000, 600)),
                 WorkerSnapshot("prefill#b", "prefill", stats(500, 100)),
                 WorkerSnapshot("decode#c", "decode", stats(300, 300))]
    gateway = GatewayMetrics("m", lambda: {s.worker_id: s.stats for s in snapshots})
    worker_metrics.register(gateway.registry, "m", lambda: snapshots)

    counters = parse_cache_counters(generate_latest(gateway.registry).decode())

    assert counters == {"prefill": CacheCounters(1500, 700), "decode": CacheCounters(300, 300)}
    assert counters["prefill"].hit_rate == 700 / 1500


def test_a_worker_without_a_role_series_counts_as_unknown() -> None:
    gateway = GatewayMetrics("m", lambda: {"colocated": stats(40, 10)})
    counters = parse_cache_counters(generate_latest(gateway.registry).decode())
    assert counters == {"unknown": CacheCounters(40, 10)}


def test_run_differences_and_sums() -> None:
    before = {"prefill": CacheCounters(100, 50)}
    after = {"prefill": CacheCounters(300, 200), "decode": CacheCounters(10, 0)}
    run = difference(after, before)
    assert run == {"prefill": CacheCounters(200, 150), "decode": CacheCounters(10, 0)}
    assert add(run, {"prefill": CacheCounters(1, 1)})["prefill"] == CacheCounters(201, 151)
    assert CacheCounters().hit_rate is None


def test_metrics_url_sits_beside_the_openai_base() -> None:
    assert metrics_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://h:1/") == "http://h:1/metrics"
