"""`tandem status`: the table and JSON from /metrics text as the gateway's own collectors write
it, and an unreachable URL. Against real gateways: tests/e2e/test_serving.py (disaggregated),
tests/e2e/test_tenants.py (/metrics behind an API key)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from tandem.services.cli import main
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.protocol.outputs import EngineStats
from tandem.services.serving import metrics as worker_metrics
from tandem.services.serving.cluster_view import WorkerSnapshot
from tandem.services.serving.status import cluster_status, render, short_id
from tests.e2e.cluster import free_port, static_server

MODEL = "SmolLM2-135M-Instruct"
PREFILL, DECODE = "p8x2k4q1", "d3m9z7c5-a-rather-long-replica-id"


def _stats(running: int, waiting: int, free: int, total: int, queries: int, hits: int
           ) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, num_free_blocks=free,
                       num_blocks=total, kv_cache_usage=(total - free) / total,
                       prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=0)


def _exposition(snapshots: list[WorkerSnapshot], in_flight: int = 0, limit: int = 0) -> str:
    """/metrics as a gateway with these workers writes it."""
    registry = CollectorRegistry()
    gateway = GatewayMetrics(MODEL, lambda: {s.worker_id: s.stats for s in snapshots}, registry)
    gateway.in_flight.labels(MODEL).set(in_flight)
    gateway.in_flight_limit.labels(MODEL).set(limit)
    worker_metrics.register(registry, MODEL, lambda: snapshots)
    return generate_latest(registry).decode()


def _disaggregated(decode_healthy: bool = True) -> str:
    prefill = WorkerSnapshot(PREFILL, "prefill", _stats(1, 2, 90, 100, 400, 100),
                             metrics={"refusals": 3}, leases=2)
    decode = WorkerSnapshot(DECODE, "decode", _stats(4, 0, 150, 200, 0, 0),
                            metrics={"transfers": 7, "transfer_failures": 1, "recomputes": 1},
                            healthy=decode_healthy)
    return _exposition([decode, prefill], in_flight=5, limit=64)


def _colocated() -> str:
    engine = WorkerSnapshot("colocated", "colocated", _stats(2, 1, 30, 40, 64, 48))
    return _exposition([engine], in_flight=3, limit=32)


def test_disaggregated_rows_come_from_the_per_worker_series() -> None:
    status = cluster_status(_disaggregated(), "http://127.0.0.1:8000")
    assert status.model == MODEL
    assert (status.in_flight, status.in_flight_limit, status.running, status.waiting) == (
        5, 64, 5, 2)
    prefill, decode = status.workers  # prefill first
    assert (prefill.worker, prefill.role, prefill.healthy) == (PREFILL, "prefill", True)
    assert (prefill.running, prefill.waiting) == (1, 2)
    assert (prefill.kv_blocks_used, prefill.kv_blocks_total) == (10, 100)
    assert prefill.kv_usage == pytest.approx(0.1)
    assert prefill.prefix_hit_rate == pytest.approx(0.25)
    assert (prefill.leases, prefill.refusals, prefill.kv_transfers) == (2, 3, None)
    assert (decode.worker, decode.role, decode.healthy) == (DECODE, "decode", True)
    assert (decode.kv_blocks_used, decode.kv_blocks_total) == (50, 200)
    assert decode.prefix_hit_rate is None  # no lookups yet
    assert (decode.kv_transfers, decode.kv_transfer_failures, decode.recomputes) == (7, 1, 1)
    assert (decode.leases, decode.refusals) == (None, 0)
    assert status.exit_code == 0


def test_the_table() -> None:
    text = render(cluster_status(_disaggregated(), "http://127.0.0.1:8000"))
    lines = text.splitlines()
    assert lines[0] == f"model {MODEL} at http://127.0.0.1:8000: gateway healthy"
    assert lines[1] == "requests: 5 in flight / 64 | sequences: 5 running, 2 waiting"
    header, prefill, decode = (line.split() for line in lines[3:])
    assert header[:4] == ["WORKER", "ROLE", "HEALTHY", "RUN+WAIT"]
    assert prefill == [PREFILL, "prefill", "yes", "1+2", "10/100", "10.0%", "25.0%", "2", "-",
                       "-", "3"]
    assert decode == [short_id(DECODE), "decode", "yes", "4+0", "50/200", "25.0%", "-", "-",
                      "7", "(1", "failed)", "1", "0"]
    assert short_id(DECODE) == "d3m9z7c5-a-ra..." and len(short_id(DECODE)) == 16


def test_an_unhealthy_worker_or_gateway_exits_1() -> None:
    status = cluster_status(_disaggregated(decode_healthy=False), "u")
    assert [w.healthy for w in status.workers] == [True, False]
    assert status.exit_code == 1
    assert " NO " in render(status).splitlines()[-1]
    down = cluster_status(_disaggregated(), "u", healthy=False, reason="no healthy decode worker")
    assert down.exit_code == 1
    assert render(down).splitlines()[0].endswith("gateway UNHEALTHY: no healthy decode worker")
    assert down.to_json()["reason"] == "no healthy decode worker"


def test_a_colocated_cluster_is_one_row_of_the_engine_numbers() -> None:
    status = cluster_status(_colocated(), "u", model="from-v1-models")
    assert status.model == "from-v1-models"
    (engine,) = status.workers
    assert (engine.worker, engine.role, engine.healthy) == ("colocated", "colocated", True)
    assert (engine.running, engine.waiting, engine.kv_blocks_used, engine.kv_blocks_total) == (
        2, 1, 10, 40)
    assert engine.prefix_hit_rate == pytest.approx(0.75)
    assert (engine.leases, engine.kv_transfers, engine.recomputes) == (None, None, None)
    row = render(status).splitlines()[-1].split()
    assert row == ["colocated", "colocated", "yes", "2+1", "10/40", "25.0%", "75.0%", "-", "-",
                   "-", "0"]


def test_unreachable_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["status", "--url", url]) == 2
    assert capsys.readouterr().err == f"tandem: error: cannot reach {url}: connection refused\n"


def test_a_garbage_answer_or_a_hung_gateway_exits_2(tmp_path: Path) -> None:
    """A real server process that answers garbage on /metrics, then the same process stopped
    (SIGSTOP): one line each, exit 2, within the timeout."""
    (tmp_path / "health").write_text("{}")
    (tmp_path / "metrics").write_text("this is { not prometheus\n")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("{}")
    with static_server(tmp_path, "/health") as (url, server):
        garbage = _status("--url", url)
        assert garbage.returncode == 2
        assert garbage.stderr.startswith(f"tandem: error: {url}/metrics is not Prometheus "
                                         f"text ("), garbage.stderr
        server.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        hung = _status("--url", url, "--timeout", "1")
        assert time.monotonic() - started < 30
        assert (hung.returncode, hung.stderr) == (
            2, f"tandem: error: cannot reach {url}: timed out\n")


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.services.cli", "status", *args],
                          capture_output=True, text=True, timeout=60)
