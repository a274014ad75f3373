"""Worker metrics the gateway exports from its workers' snapshots: the attention backend each
engine runs."""

from __future__ import annotations

from tandem.services.protocol.outputs import EngineStats
from tandem.services.serving.cluster_view import WorkerSnapshot
from tandem.services.serving.metrics import WorkerCollector


def _snapshot(worker_id: str, role: str, backend: str) -> WorkerSnapshot:
    stats = EngineStats(num_running=0, num_waiting=0, num_free_blocks=8, num_blocks=8,
                        kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                        num_preemptions=0)
    return WorkerSnapshot(worker_id, role, stats, attention_backend=backend)


def test_each_worker_reports_the_attention_backend_it_runs() -> None:
    collector = WorkerCollector("m", lambda: [_snapshot("p0", "prefill", "cpu"),
                                              _snapshot("d0", "decode", "torch"),
                                              _snapshot("d1", "decode", "")])  # not known yet
    [family] = [f for f in collector.collect() if f.name == "tandem_attention_backend"]
    got = {(s.labels["worker"], s.labels["role"], s.labels["backend"]): s.value
           for s in family.samples}
    assert got == {("p0", "prefill", "cpu"): 1.0, ("d0", "decode", "torch"): 1.0}
