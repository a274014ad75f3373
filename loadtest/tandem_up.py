"""`tandem up --config FILE` as a subprocess on free loopback ports, for drivers that compare
Tandem configurations: start, wait for the ready line, SIGTERM, and clean up what it started.

The child runs in a session of its own, so that if it does not exit in time its whole process
group (the Ray processes it started) can be killed without touching anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.loadtest.ports import free_port

READY = re.compile(r"^Tandem ready: HTTP (http://\S+)/v1\s+gRPC (\S+)")
TANDEM_UP = (sys.executable, "-m", "tandem.services.cli", "up")


class LaunchError(RuntimeError):
    """`tandem up` exited or stayed silent instead of printing its ready line."""


def parse_cpus(text: str) -> str:
    """Check a `taskset -c` CPU list ("0,1" or "0-3"); returns it unchanged."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        raise ValueError(f"a CPU list is like 0,1 or 0-3, got {text!r}")
    return text


def cpus_argument(text: str) -> str:
    """``parse_cpus`` as an argparse ``type=``: a bad list is a usage error."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class TandemUp:
    """One `tandem up` child. ``command`` is the program and its leading arguments (a test may
    substitute any program that prints the ready line)."""

    config_path: Path
    log_path: Path
    cpus: str | None = None  # pin the child and everything it starts (`taskset -c`)
    ready_timeout_s: float = 600.0
    command: tuple[str, ...] = TANDEM_UP
    http_url: str = ""  # http://host:port, once ready
    ready_s: float = 0.0
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> TandemUp:
        port = free_port()
        grpc_port = free_port()
        while grpc_port == port:
            grpc_port = free_port()
        argv = [*self.command, "--config", str(self.config_path), "--port", str(port),
                "--grpc-port", str(grpc_port)]
        if self.cpus is not None:
            argv = ["taskset", "-c", self.cpus, *argv]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        started = time.monotonic()
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                            env=env, start_new_session=True)
        line = self._ready_line()
        match = READY.match(line or "")
        if match is None:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise LaunchError(f"no ready line from {' '.join(argv)} within "
                              f"{self.ready_timeout_s:.0f} s (got {line!r}); log "
                              f"{self.log_path}:\n{tail}")
        self.http_url = match.group(1)
        self.ready_s = time.monotonic() - started
        return self

    def _ready_line(self) -> str | None:
        """The child's first stdout line, or None if it exits or the timeout passes first."""
        assert self.process is not None and self.process.stdout is not None
        stdout = self.process.stdout
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.ready_timeout_s)
        return lines[0].strip() if lines and lines[0] else None

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM (a clean shutdown of Serve and Ray), then SIGKILL to the child's process
        group if it is still there after ``timeout_s``. Returns the exit code."""
        return stop_group(self.process, timeout_s)


def stop_group(process: subprocess.Popen[str] | None, timeout_s: float) -> int | None:
    """SIGTERM a child that leads its own session, then SIGKILL its whole process group if it
    is still there after ``timeout_s``. Returns the exit code."""
    if process is None:
        return None
    pgid = process.pid  # the child leads its own session and group
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code: int | None = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # whatever of its group is left
    if code is None:
        code = process.wait(10)
    if process.stdout is not None:
        process.stdout.close()
    return code
