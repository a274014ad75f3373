"""Fixtures for router tests: a real redis-server on a free loopback port, and a cluster helper.

``redis_server`` can be killed and restarted on the same port mid-test, or paused (SIGSTOP);
``redis_later`` is one not started yet (its port refuses connections until ``start()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.loadtest.ports import free_port
from tests.redis_server import RedisServer, running_redis

__all__ = ["RedisServer", "free_port", "wait_until"]  # what the router's tests import here


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0,
               interval_s: float = 0.01, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture
def redis_later(tmp_path: Path) -> Iterator[RedisServer]:
    """A RedisServer whose port nothing listens on until the test calls ``start()``."""
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()
