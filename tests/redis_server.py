"""A real redis-server on a free loopback port (the router's and the Responses store's tests):
it can be killed and restarted on the same port mid-test, or paused (SIGSTOP)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tandem.loadtest.ports import free_port
from tandem.router import connect

STARTUP_DEADLINE_S = 10.0


class RedisServer:
    """One redis-server process without persistence, bound to 127.0.0.1."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return connect(self.url)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        assert not self.running, "redis-server already running"
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self._proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
             "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.2,
                            socket_connect_timeout=0.2)
        try:
            deadline = time.monotonic() + STARTUP_DEADLINE_S
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self._log_tail()}")
                try:
                    if probe.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer PING: {self._log_tail()}")
                time.sleep(0.01)
        finally:
            probe.close()

    def pause(self) -> None:
        """SIGSTOP: connections open, nothing answers (commands time out)."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        if self._proc is not None and self._paused:
            os.kill(self._proc.pid, signal.SIGCONT)
        self._paused = False

    def kill(self) -> None:
        """SIGKILL, as a crash would: everything in memory is lost."""
        self.resume()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def stop(self) -> None:
        self.resume()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            self._proc = None

    def _log_tail(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A started server, stopped at the end."""
    server = RedisServer(workdir)
    for attempt in range(3):  # the free port may be taken before redis-server binds it
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 2:
                raise
            server.port = free_port()
    try:
        yield server
    finally:
        server.stop()
