"""What `tandem up` prints: --version, and a replica that fails to start stopping it at once, with
nothing left behind. Its start-up progress and stats lines are checked on the keyed colocated
cluster of tests/e2e/test_tenants.py (one cluster start fewer; its stats poll needs a key)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tandem.services.version import version
from tests.e2e.cluster import TANDEM, free_port

pytestmark = pytest.mark.timeout(300)

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
