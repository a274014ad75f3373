"""Per-worker series the gateway's own metrics lack: free KV blocks, leases, KV transfer."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.serving.cluster_view import WorkerSnapshot

SnapshotSource = Callable[[], list[WorkerSnapshot]]


class WorkerCollector(Collector):
    def __init__(self, model_name: str, source: SnapshotSource) -> None:
        self._model_name = model_name
        self._source = source

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker", "role"]
        free = GaugeMetricFamily("tandem_kv_cache_free_blocks",
                                 "KV blocks free (cached-but-unused blocks count as free).",
                                 labels=labels)
        total = GaugeMetricFamily("tandem_kv_cache_blocks", "KV blocks in the cache.",
                                  labels=labels)
        leases = GaugeMetricFamily("tandem_prefill_leases",
                                   "Prompt KV held by a prefill worker for a transfer.",
                                   labels=labels)
        moved = CounterMetricFamily("tandem_kv_transfer_bytes",
                                    "KV bytes a decode worker pulled from prefill workers.",
                                    labels=labels)
        seconds = CounterMetricFamily("tandem_kv_transfer_seconds",
                                      "Time a decode worker spent pulling KV blocks.",
                                      labels=labels)
        transfers = CounterMetricFamily("tandem_kv_transfers",
                                        "KV pulls by a decode worker.", labels=labels)
        for w in self._source():
            key = [self._model_name, w.worker_id, w.role]
            free.add_metric(key, w.stats.num_free_blocks)
            total.add_metric(key, w.stats.num_blocks)
            if w.role == "prefill":
                leases.add_metric(key, w.leases)
            else:
                moved.add_metric(key, float(w.metrics.get("bytes_moved", 0)))
                seconds.add_metric(key, float(w.metrics.get("transfer_seconds", 0.0)))
                transfers.add_metric(key, float(w.metrics.get("transfers", 0)))
        yield from (free, total, leases, moved, seconds, transfers)


def register(registry: CollectorRegistry, model_name: str, source: SnapshotSource) -> None:
    registry.register(WorkerCollector(model_name, source))
