"""/metrics as a disaggregated gateway's own collectors write it (one prefill and one decode
worker), with the counters the planner reads set: recorded metrics for its tests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from tandem.services.gateway.metrics import REJECTED, GatewayMetrics
from tandem.services.protocol.outputs import EngineStats
from tandem.services.protocol.request import DEFAULT_TENANT
from tandem.services.serving import metrics as worker_metrics
from tandem.services.serving.cluster_view import WorkerSnapshot

MODEL = "SmolLM2-135M-Instruct"


def _stats(queries: int, hits: int) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_free_blocks=100, num_blocks=100,
                       kv_cache_usage=0.0, prefix_cache_queries=queries,
                       prefix_cache_hits=hits, num_preemptions=0)


def gateway_metrics(ended: int, prompt: int, generated: int, hits: int,
                    failed: int = 0) -> str:
    """Totals since start: ``ended`` requests with ``prompt`` prompt and ``generated`` output
    tokens, ``failed`` refused; the prefill worker looked up every prompt token and found
    ``hits`` cached; the decode worker found all of them (its KV came from the prefill worker)."""
    snapshots = [WorkerSnapshot("p1", "prefill", _stats(prompt, hits)),
                 WorkerSnapshot("d1", "decode", _stats(prompt, prompt))]
    registry = CollectorRegistry()
    gateway = GatewayMetrics(MODEL, lambda: {s.worker_id: s.stats for s in snapshots}, registry)
    gateway.success.labels(MODEL, DEFAULT_TENANT, "length").inc(ended)
    gateway.prompt_tokens.labels(MODEL, DEFAULT_TENANT).inc(prompt)
    gateway.generation_tokens.labels(MODEL, DEFAULT_TENANT).inc(generated)
    for _ in range(failed):
        gateway.fail(DEFAULT_TENANT, REJECTED)
    worker_metrics.register(registry, MODEL, lambda: snapshots)
    return generate_latest(registry).decode()


def colocated_metrics(ended: int) -> str:
    registry = CollectorRegistry()
    stats = _stats(10 * ended, 0)
    gateway = GatewayMetrics(MODEL, lambda: {"colocated": stats}, registry)
    gateway.success.labels(MODEL, DEFAULT_TENANT, "length").inc(ended)
    return generate_latest(registry).decode()
