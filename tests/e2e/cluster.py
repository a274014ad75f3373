"""`tandem up` as a subprocess: free ports, the ready line, SIGTERM, and a leftover check."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

from tandem.loadtest.ports import free_port

READY = re.compile(r"^Tandem ready: HTTP (http://\S+)/v1\s+gRPC (\S+)")
TANDEM = Path(sys.executable).with_name("tandem")


@dataclass
class UpProcess:
    args: list[str]
    log_path: Path
    ready_timeout_s: float = 240.0
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    launcher: list[str] = field(default_factory=list)  # before `tandem up` (e.g. ip netns exec)
    http_url: str = ""
    grpc_target: str = ""
    ready_s: float = 0.0
    ready_line: str = ""
    process: subprocess.Popen[str] | None = None
    _descendants: list[psutil.Process] = field(default_factory=list)

    @classmethod
    def from_settings(cls, root: Path, settings: dict[str, object],
                      env: dict[str, str] | None = None) -> UpProcess:
        """`tandem up --config` with ``settings`` written to ``root``/tandem.yaml (not started);
        float32 unless they name a dtype (``start``)."""
        config = root / "tandem.yaml"
        config.write_text(yaml.safe_dump({"dtype": "float32", **settings}))
        return cls(["--config", str(config)], root / "tandem-up.log", env=env or {})

    def start(self) -> UpProcess:
        port, grpc_port = free_port(), free_port()
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", **self.env}
        started = time.monotonic()
        # float32 unless the test names a dtype: the clusters' outputs are compared with
        # transformers' float32 ones (plain `tandem up` would pick bfloat16 on this machine).
        named = "--dtype" in self.args or "--config" in self.args
        self.process = subprocess.Popen(
            [*self.launcher, str(TANDEM), "up", "--port", str(port), "--grpc-port",
             str(grpc_port),
             *([] if named else ["--dtype", "float32"]), *self.args],
            stdout=subprocess.PIPE, stderr=self.log_path.open("w"), text=True, env=env,
            start_new_session=True)  # a group of its own, as a shell's job or a container
        line = _read_line(self.process, self.ready_timeout_s)
        match = READY.match(line or "")
        if match is None:
            self.stop()
            raise AssertionError(f"no ready line from tandem up (got {line!r}); log:\n"
                                 + self.log_path.read_text()[-4000:])
        self.ready_s = time.monotonic() - started
        self.ready_line = line or ""
        self.http_url, self.grpc_target = match.group(1), match.group(2)
        return self

    def descendants(self) -> list[psutil.Process]:
        assert self.process is not None
        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self, timeout_s: float = 60.0, group: bool = False) -> int:
        """SIGTERM (to its whole process group with ``group``, as `docker stop` or systemd
        send it: Ray's processes get it too), wait for exit; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self._descendants = self.descendants()
            if group:
                os.killpg(self.process.pid, signal.SIGTERM)
            else:
                self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        finally:
            for proc in self._descendants:  # only what this command started
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()

    def leftovers(self, timeout_s: float = 20.0) -> list[str]:
        """Processes started by the command still alive after it exited (polled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [p for p in self._descendants
                     if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive or time.monotonic() > deadline:
                return [f"{p.pid} {' '.join(p.cmdline()[:2])}" for p in alive]
            time.sleep(0.1)


def _read_line(process: subprocess.Popen[str], timeout_s: float) -> str | None:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    reader.join(timeout_s)
    return result[0].strip() if result else None


def metric_values(http_url: str, name: str, headers: dict[str, str] | None = None
                  ) -> dict[tuple[tuple[str, str], ...], float]:
    """{labels: value} of one Prometheus series name on /metrics."""
    text = httpx.get(f"{http_url}/metrics", headers=headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels_text, value = line[len(name) + 1:].rsplit("} ", 1)
            labels = tuple(sorted(tuple(part.split("=", 1)) for part in
                                  re.findall(r'\w+="[^"]*"', labels_text)))
            values[tuple((k, v.strip('"')) for k, v in labels)] = float(value)
    return values


def per_worker(values: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    return {dict(labels)["worker"]: value for labels, value in values.items()}


def all_blocks_free(cluster: UpProcess, workers: int = 2) -> bool:
    """Every KV block free on each of ``workers`` workers and no prefill lease held (from the
    gateway's /metrics, which the workers' status polls refresh)."""
    free = per_worker(metric_values(cluster.http_url, "tandem_kv_cache_free_blocks"))
    total = per_worker(metric_values(cluster.http_url, "tandem_kv_cache_blocks"))
    leases = per_worker(metric_values(cluster.http_url, "tandem_prefill_leases"))
    return len(free) == workers and free == total and not any(leases.values())


def wait_for(check, timeout_s: float, what: str,  # type: ignore[no-untyped-def]
             poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(poll_s)


@contextlib.contextmanager
def static_server(directory: Path, ready_path: str
                  ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real HTTP server process serving ``directory`` (its URL and process), once
    ``ready_path`` answers; killed on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(directory)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def answers() -> bool:
        try:
            return httpx.get(f"{url}{ready_path}", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, 30, "the stand-in server to answer")
        yield url, server
    finally:
        server.send_signal(signal.SIGCONT)  # in case a test stopped it
        server.kill()
        server.wait(timeout=30)


def resume_stopped_worker(cluster: UpProcess) -> None:
    """SIGCONT the worker that stopped itself (the test-only ``sigstop`` fault, exactly one)."""
    stopped: list[psutil.Process] = []

    def find() -> bool:
        stopped[:] = [p for p in cluster.descendants() if p.status() == psutil.STATUS_STOPPED]
        return bool(stopped)

    wait_for(find, 10, "the prefill worker to stop itself")
    assert len(stopped) == 1
    stopped[0].send_signal(signal.SIGCONT)
