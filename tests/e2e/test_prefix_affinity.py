"""With 2 prefill workers, repeated shared-prefix prompts hit the cache of the worker that holds
each prefix (the router's choice reaches the right Serve replica)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import UpProcess, metric_values, per_worker

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PREFIX_BLOCKS = 12
REPEATS = 3


@pytest.fixture(scope="module")
def two_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    log = Path(tmp_path_factory.mktemp("up2")) / "tandem-up.log"
    up = UpProcess(["--prefill", "2", "--decode", "1", "--kv-transport", "tcp"], log).start()
    try:
        yield up
    finally:
        assert up.stop() == 0
        assert up.leftovers() == []


def test_prefix_hits_concentrate(two_prefill: UpProcess) -> None:
    prefixes = [[1000 + 37 * tenant + i for i in range(PREFIX_BLOCKS * BLOCK)]
                for tenant in range(4)]
    for repeat in range(REPEATS):
        for tenant, prefix in enumerate(prefixes):
            prompt = [*prefix, 5000 + 10 * repeat + tenant, 7]
            response = httpx.post(f"{two_prefill.http_url}/v1/completions", timeout=60,
                                  json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200, response.text
    url = two_prefill.http_url
    roles = {dict(k)["worker"]: dict(k)["role"]
             for k in metric_values(url, "tandem_kv_cache_blocks")}
    hits = {w: v for w, v in per_worker(metric_values(url, "tandem_prefix_cache_hits_total")
                                        ).items() if roles.get(w) == "prefill"}
    queries = {w: v for w, v in per_worker(
        metric_values(url, "tandem_prefix_cache_queries_total")).items()
        if roles.get(w) == "prefill"}
    assert len(hits) == 2, (hits, roles)
    # A repeat whose whole prompt the decode worker already caches (from an earlier import)
    # may skip prefill by design; every other repeat must find its whole prefix on P.
    prompt_len = PREFIX_BLOCKS * BLOCK + 2
    to_prefill, rest = divmod(int(sum(queries.values())), prompt_len)
    assert rest == 0, queries
    skipped = len(prefixes) * REPEATS - to_prefill
    assert 0 <= skipped <= len(prefixes) * (REPEATS - 1), queries
    repeats_on_prefill = to_prefill - len(prefixes)
    repeats_hit = int(sum(hits.values())) // (PREFIX_BLOCKS * BLOCK)
    # Every repeat sent to P finds its whole prefix there (random placement over 2 workers would
    # hit half): the router's choice reaches the replica, and no worker's KV events are lost or
    # applied out of order (D's final report used to be dropped with the stream's last output).
    assert repeats_hit == repeats_on_prefill, (hits, queries)
    # Every worker report reached the router: no numbered KV event went missing.
    gaps = metric_values(url, "tandem_router_event_gaps_total")
    assert sum(gaps.values()) == 0, gaps
    # Each worker's hits are whole prefixes it served before (no scattered partial hits).
    for worker, value in hits.items():
        assert value % (PREFIX_BLOCKS * BLOCK) == 0, (worker, hits)
        assert value <= queries[worker]
