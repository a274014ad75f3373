"""`tandem up --redis-url`: workers register in Redis and publish KV events to its stream; the
gateway routes from that shared state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router import RedisRegistry
from tests.e2e.cluster import UpProcess, wait_for
from tests.router.conftest import RedisServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[UpProcess, RedisServer]]:
    workdir = Path(tmp_path_factory.mktemp("redis-mode"))
    server = RedisServer(workdir)
    server.start()
    up = UpProcess(["--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
                    "--redis-url", server.url], workdir / "tandem-up.log")
    try:
        up.start()
        yield up, server
    finally:
        assert up.stop() == 0
        assert up.leftovers() == []
        server.stop()


def test_workers_register_and_publish_events_in_redis(redis_cluster) -> None:
    up, server = redis_cluster
    client = server.client()
    registry = RedisRegistry(client)
    wait_for(lambda: sorted(r.info.role for r in registry.workers()) == ["decode", "prefill"],
             60, "a prefill and a decode worker in the Redis registry")
    prompt = list(range(1000, 1064))  # four full blocks
    for _ in range(2):
        response = httpx.post(f"{up.http_url}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    wait_for(lambda: client.xlen("tandem:kv-events") > 0, 30, "KV events on the Redis stream")
