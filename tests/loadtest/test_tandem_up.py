"""The `tandem up` launcher with stand-in programs: the ready line, SIGTERM, what is left over,
and a child that fails or stays silent. (Real `tandem up` runs are in tests/e2e.)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tandem.loadtest.tandem_up import LaunchError, TandemUp, parse_cpus

# Prints the ready line for the ports it is given, starts a grandchild that outlives it (its pid
# in grandchild.pid) and exits 0 on SIGTERM, leaving the grandchild behind.
SERVER = """
import argparse, signal, subprocess, sys, threading
from pathlib import Path
p = argparse.ArgumentParser()
p.add_argument("--config"); p.add_argument("--port"); p.add_argument("--grpc-port")
a = p.parse_args()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
Path(a.config).with_name("grandchild.pid").write_text(str(child.pid))
print(f"Tandem ready: HTTP http://127.0.0.1:{a.port}/v1  gRPC 127.0.0.1:{a.grpc_port}  (x)",
      flush=True)
stop.wait()
Path(a.config).with_name("stopped").write_text(Path(a.config).read_text())
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def script(tmp_path: Path, text: str) -> tuple[str, ...]:
    path = tmp_path / "server.py"
    path.write_text(text)
    return (sys.executable, str(path))


def test_ready_line_gives_the_url_and_stop_leaves_nothing_behind(tmp_path: Path) -> None:
    config = tmp_path / "a.yaml"
    config.write_text("colocated: true\n")
    up = TandemUp(config, tmp_path / "a.log", ready_timeout_s=60,
                  command=script(tmp_path, SERVER)).start()
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert up.http_url.startswith("http://127.0.0.1:")
    assert int(up.http_url.rsplit(":", 1)[1]) > 0
    assert alive(grandchild)

    assert up.stop(timeout_s=30) == 0
    assert (tmp_path / "stopped").read_text() == "colocated: true\n"  # it got --config
    deadline = time.monotonic() + 10
    while alive(grandchild):  # killed with the child's process group
        assert time.monotonic() < deadline, "the grandchild outlived stop()"
        time.sleep(0.05)


def test_a_child_that_exits_without_the_ready_line_raises_with_its_log(tmp_path: Path) -> None:
    failing = script(tmp_path, "import sys\nprint('tandem: error: no such model', "
                               "file=sys.stderr)\nsys.exit(2)\n")
    up = TandemUp(tmp_path / "a.yaml", tmp_path / "a.log", ready_timeout_s=60, command=failing)
    with pytest.raises(LaunchError, match="(?s)got None.*tandem: error: no such model"):
        up.start()
    assert up.process is not None and up.process.returncode == 2


def test_a_silent_child_is_stopped_after_the_ready_timeout(tmp_path: Path) -> None:
    silent = script(tmp_path, "import time\ntime.sleep(300)\n")
    up = TandemUp(tmp_path / "a.yaml", tmp_path / "a.log", ready_timeout_s=1.0, command=silent)
    started = time.monotonic()
    with pytest.raises(LaunchError, match="within 1 s"):
        up.start()
    assert up.process is not None and up.process.poll() is not None
    assert time.monotonic() - started < 30


def test_cpu_lists() -> None:
    assert parse_cpus("0,1") == "0,1" and parse_cpus("0-3,6") == "0-3,6"
    for bad in ("", "a", "0,", "1--2"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)
    assert os.cpu_count()
