"""What `tandem up` prints: --version, start-up progress and stats on stderr (the ready line alone
on stdout), and a replica that fails to start stopping it at once, with nothing left behind."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from services.version import version
from tests.e2e.cluster import TANDEM, UpProcess, free_port, metric_values, wait_for

pytestmark = pytest.mark.timeout(300)

STATS = re.compile(r"INFO stats: (\d+) running, (\d+) waiting \| prompt ([\d.]+) tok/s, "
                   r"generation ([\d.]+) tok/s \| KV cache ([\d.]+)% \| prefix cache hit rate "
                   r"(-|[\d.]+%) \| (\d+) requests ended: (\d+) prompt, (\d+) generated tokens$")
STATS_INTERVAL_S = 1


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`tandem up --colocated` printing a stats line every second something changed."""
    log = Path(tmp_path_factory.mktemp("up-output")) / "tandem-up.log"
    up = UpProcess(["--colocated", "--stats-interval", str(STATS_INTERVAL_S)], log).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.parametrize("argv", [["--version"], ["up", "--version"]])
def test_version(argv: list[str]) -> None:
    done = subprocess.run([str(TANDEM), *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"tandem {version()}"


def _run_until_exit(args: list[str], log_path: Path, timeout_s: float
                    ) -> tuple[int, str, str, float, list[psutil.Process]]:
    """`tandem up ARGS` to its exit: (exit code, stdout, stderr, seconds, every process it
    started, seen while it ran)."""
    started = time.monotonic()
    with log_path.open("w") as stderr:
        process = subprocess.Popen([str(TANDEM), "up", "--port", str(free_port()), "--grpc-port",
                                    str(free_port()), *args],
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
    seen: dict[int, psutil.Process] = {}
    try:
        while process.poll() is None and time.monotonic() - started < timeout_s:
            try:
                for child in psutil.Process(process.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.2)  # sampling the process tree, not waiting on it
        elapsed = time.monotonic() - started
        if process.poll() is None:
            process.kill()
        out = process.communicate()[0]
    finally:
        for child in seen.values():  # only what this command started, if it outlived it
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                child.kill()
    return process.returncode, out, log_path.read_text(), elapsed, list(seen.values())


def _alive(processes: list[psutil.Process], timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return [f"{p.pid} {p.name()}" for p in alive]
        time.sleep(0.1)


def test_a_missing_model_fails_before_ray_starts(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.gguf"
    rc, out, err, elapsed, started = _run_until_exit(["--model", str(missing)],
                                                     tmp_path / "up.log", 60)
    assert rc != 0 and elapsed < 60, err
    assert out == ""
    assert f"tandem: error: model: {missing} does not exist" in err
    assert not started, "Ray started for a model file that does not exist"


def test_a_replica_that_fails_to_start_stops_up_at_once(tmp_path: Path) -> None:
    """A model file that exists but is no GGUF: the gateway's loader fails in its replica;
    `tandem up` says so in one line and exits, Ray and every replica gone."""
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\x00not a gguf file\xff" * 4)
    rc, out, err, elapsed, started = _run_until_exit(["--colocated", "--model", str(garbage)],
                                                     tmp_path / "up.log", 60)
    assert rc == 1 and elapsed < 60, (rc, elapsed, err[-4000:])
    assert out == ""  # no ready line
    assert err.rstrip().splitlines()[-1] == (
        "tandem: error: the gateway replica failed to start: ModelLoadError: not a valid GGUF "
        f"file: {garbage} (bad magic)"), err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert started, "no process was started: the check ran before Ray, not in the replica"
    assert _alive(started) == []


def test_startup_progress_goes_to_stderr(colocated: UpProcess) -> None:
    err = colocated.log_path.read_text()
    assert re.search(r"^\d\d:\d\d:\d\d INFO Ray is up in [\d.]+ s", err, re.M), err
    assert re.search(r"INFO gateway: replica 1/1 up: engine loaded SmolLM2-135M-Instruct "
                     r"\(built-in\) in [\d.]+ s$", err, re.M), err
    assert "Tandem ready" not in err  # the ready line is stdout's alone


def _stats_lines(cluster: UpProcess) -> list[re.Match[str]]:
    return [m for m in map(STATS.search, cluster.log_path.read_text().splitlines()) if m]


def _total(cluster: UpProcess, name: str) -> float:
    return sum(metric_values(cluster.http_url, name).values())


def test_stats_line_matches_metrics(colocated: UpProcess) -> None:
    before = len(_stats_lines(colocated))
    prompt = "Tandem prints a line of stats every interval in which something changed."
    with httpx.Client(base_url=colocated.http_url, timeout=60) as client:
        for _ in range(3):  # the same prompt: the 2nd and 3rd hit the prefix cache
            response = client.post("/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8,
                "temperature": 0})
            assert response.status_code == 200, response.text
    # Idle now: /metrics holds still, and the next stats line (within an interval) shows it.
    ended = _total(colocated, "tandem_request_success_total")
    assert ended >= 3

    def settled() -> bool:
        lines = _stats_lines(colocated)
        return len(lines) > before and int(lines[-1].group(7)) == ended

    wait_for(settled, 10 * STATS_INTERVAL_S, "a stats line with every request ended")
    last = _stats_lines(colocated)[-1]
    kv = list(metric_values(colocated.http_url, "tandem_kv_cache_usage_perc").values())
    assert len(kv) == 1
    assert last.group(1, 2) == ("0", "0")
    assert _total(colocated, "tandem_num_requests_running") == 0
    assert _total(colocated, "tandem_num_requests_waiting") == 0
    assert last.group(5) == f"{100 * kv[0]:.1f}"
    assert int(last.group(8)) == _total(colocated, "tandem_prompt_tokens_total")
    assert int(last.group(9)) == _total(colocated, "tandem_generation_tokens_total")
    # The lines since the requests began: their rates cover the tokens that ended meanwhile.
    new = _stats_lines(colocated)[before:]
    assert any(float(m.group(3)) > 0 for m in new) and any(float(m.group(4)) > 0 for m in new)
    assert any(m.group(6) != "-" for m in new)  # prompt tokens were looked up in the cache
    # Nothing changes while idle, so nothing more is printed.
    time.sleep(3 * STATS_INTERVAL_S)
    assert len(_stats_lines(colocated)) == before + len(new)
