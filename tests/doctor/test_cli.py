"""``tandem doctor`` as a command: against a real HTTP server process serving a recorded
/metrics (a gateway of the prefix-heavy state), an unreachable one, and its imports."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.services.cli import main
from tests.e2e.cluster import free_port, static_server
from tests.gateway.test_imports import modules_after

from .metrics_text import prefix_state


@pytest.fixture
def recorded_gateway(tmp_path: Path) -> Iterator[str]:
    """A real server process whose /metrics is the prefix state's last read."""
    evidence = prefix_state()
    lines = [f"{name}{{{','.join(f'{k}={json.dumps(v)}' for k, v in labels)}}} {value}"
             for name, labels, value in evidence.last.samples]
    (tmp_path / "metrics").write_text("\n".join(lines) + "\n")
    with static_server(tmp_path, "/metrics") as (url, _):
        yield url


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.services.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=120)


def test_json_and_report_files_from_a_recorded_gateway(recorded_gateway: str,
                                                       tmp_path: Path) -> None:
    done = doctor("--url", recorded_gateway, "--window", "0", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["recommended"][0] == "prefix_routing"
    assert report["levers"][0]["change"] == "--routing-policy prefix"
    out = tmp_path / "report"
    done = doctor("--url", recorded_gateway, "--window", "0", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"# tandem doctor: {recorded_gateway}\n")
    assert "Measured over everything since the gateway started." in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["batch_kv.png", "latency.png", "report.md"]
    assert "![latency breakdown](latency.png)" in (out / "report.md").read_text()
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_unreachable_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["doctor", "--url", url, "--window", "0"]) == 2
    assert capsys.readouterr().err == f"tandem: error: cannot reach {url}: connection refused\n"


def test_a_window_without_traffic_exits_1(recorded_gateway: str) -> None:
    done = doctor("--url", recorded_gateway, "--window", "0.5", "--interval", "0.2")
    assert done.returncode == 1
    measuring, no_traffic = done.stderr.splitlines(keepends=True)
    assert measuring == f"tandem doctor: measuring {recorded_gateway} for 0.5 s\n"
    assert no_traffic.startswith("tandem doctor: no request ended in the 0.")
    assert no_traffic.endswith(" s window: send traffic during it, or use --window 0 (since "
                                "the gateway started)\n")


def test_doctor_imports_no_torch_nor_ray() -> None:
    loaded = modules_after("""
        from tandem.services.cli import main
        import tandem.services.doctor.cli, tandem.services.doctor.report
    """)
    assert "tandem.services" in loaded
    assert not loaded & {"torch", "ray"}


def test_garbage_and_a_hung_gateway_are_one_line_each(tmp_path: Path) -> None:
    """A /metrics that is not Prometheus text, then the server stopped (SIGSTOP): exit 2 with
    one line each, the hung one within --timeout."""
    (tmp_path / "metrics").write_text("this is { not prometheus\n")
    with static_server(tmp_path, "/metrics") as (url, server):
        garbage = doctor("--url", url, "--window", "0", "--timeout", "1")
        assert garbage.returncode == 2
        assert garbage.stderr.startswith(f"tandem: error: {url}/metrics is not Prometheus "
                                         "text ("), garbage.stderr
        server.send_signal(signal.SIGSTOP)
        hung = doctor("--url", url, "--window", "0", "--timeout", "1")
        assert (hung.returncode, hung.stderr) == (
            2, f"tandem: error: cannot reach {url}: timed out\n")
