"""`tandem up --colocated` with API keys from TANDEM_API_KEYS (its private key and secret files):
both front ends refuse a missing or wrong key before any work, two tenants never share cached
prompts whatever `cache_salt` they send, a tenant over its rate limit gets 429 + Retry-After
while the other is served, and the request metrics carry the tenant. `tandem status` and
`tandem chat` with and without a key; and what `tandem up` prints on stderr here (start-up
progress; its stats line, read from /metrics with a key, equal to /metrics)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tests.e2e.cluster import TANDEM, UpProcess, metric_values, wait_for
from tests.gateway.helpers import cached_tokens

pytestmark = pytest.mark.timeout(300)

KEYS = "acme:key-acme-1,acme:key-acme-2,bolt:key-bolt"
STATS = re.compile(r"INFO stats: (\d+) running, (\d+) waiting \| prompt ([\d.]+) tok/s, "
                   r"generation ([\d.]+) tok/s \| KV cache ([\d.]+)% \| prefix cache hit rate "
                   r"(-|[\d.]+%) \| (\d+) requests ended: (\d+) prompt, (\d+) generated tokens$")
STATS_INTERVAL_S = 1
PROMPT = list(range(2000, 2512))  # 512 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = UpProcess.from_settings(Path(tmp_path_factory.mktemp("tenants")),
                                 {"colocated": True, "tenant_tokens_per_minute": 1200},
                                 {"TANDEM_API_KEYS": KEYS})
    up.args += ["--metrics-require-key", "--stats-interval", str(STATS_INTERVAL_S)]
    up.start()
    try:
        yield up
    finally:
        assert up.stop() == 0


def client(cluster: UpProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{cluster.http_url}/v1", max_retries=0,
                         timeout=120)


def scrape(cluster: UpProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    assert httpx.get(f"{cluster.http_url}/metrics", timeout=10).status_code == 401
    return metric_values(cluster.http_url, name, {"authorization": "Bearer key-bolt"})


def test_keys_tenants_and_limits(cluster: UpProcess) -> None:
    url = cluster.http_url
    # No key, a wrong key: refused on both front ends.
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(cluster, "key-nobody").completions.create(model="", prompt="Hi", max_tokens=1)
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(max_tokens=1))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.Generate(request, timeout=60,
                                     metadata=[("authorization", "Bearer key-bolt")]))
        assert replies[-1].usage.completion_tokens == 1

    def cached(key: str, salt: str | None = None) -> int:
        return cached_tokens(client(cluster, key), PROMPT, salt)

    assert cached("key-acme-1", "s") == 0
    assert cached("key-acme-2", "s") == 496  # the same tenant
    assert cached("key-bolt") == 0  # the other tenant
    assert cached("key-bolt", "s") == 0  # with acme's cache_salt too
    # acme has used 2 x 513 of its 1,200 tokens a minute: a request that may use 1,001 must wait
    # for ~40 s of refill, so it is refused; bolt's small one is served.
    acme = client(cluster, "key-acme-1")
    with pytest.raises(openai.RateLimitError) as limited:
        acme.completions.create(model="", prompt="Hi", max_tokens=1000)
    assert int(limited.value.response.headers["retry-after"]) >= 1
    client(cluster, "key-bolt").completions.create(model="", prompt="Hi", max_tokens=1)
    failures = {(dict(k)["tenant"], dict(k)["reason"]): v
                for k, v in scrape(cluster, "tandem_request_failures_total").items()}
    assert failures[("acme", "rejected")] == 1 and failures[("bolt", "rejected")] == 0
    ended: dict[str, float] = {}
    for labels, value in scrape(cluster, "tandem_request_success_total").items():
        ended[dict(labels)["tenant"]] = ended.get(dict(labels)["tenant"], 0) + value
    assert ended == {"acme": 2, "bolt": 4}


def test_status_with_metrics_behind_a_key(cluster: UpProcess) -> None:
    """`tandem status` against this gateway, whose /metrics needs a key: none or a wrong one
    exits 2 saying so; a tenant's key shows the one colocated engine."""
    def status(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
        return subprocess.run([str(TANDEM), "status", "--url", cluster.http_url, *args],
                              capture_output=True, text=True, timeout=60, env=env)

    missing, wrong = status(), status("--api-key", "key-nobody")
    assert (missing.returncode, missing.stderr) == (
        2, "tandem: error: /metrics needs an API key (--api-key)\n")
    assert (wrong.returncode, wrong.stderr) == (
        2, "tandem: error: /metrics refused the API key (401)\n")
    done = status("--api-key", "key-bolt", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["healthy"], data["exit_code"]) == (True, 0)
    [engine] = data["workers"]
    blocks = scrape(cluster, "tandem_kv_cache_blocks")
    assert (engine["worker"], engine["role"]) == ("colocated", "colocated")
    assert engine["kv_blocks_total"] == sum(blocks.values())


def test_chat_sends_the_key(cluster: UpProcess) -> None:
    """`tandem chat` with a tenant's key streams the same greedy reply as the API; without a
    key it exits 1 with the gateway's 401 message."""
    question = "Name a colour."
    expected = client(cluster, "key-bolt").chat.completions.create(
        model="", messages=[{"role": "user", "content": question}], max_tokens=8,
        temperature=0).choices[0].message.content

    def chat(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
        return subprocess.run([str(TANDEM), "chat", question, "--url", cluster.http_url,
                               "--max-tokens", "8", *args],
                              capture_output=True, text=True, timeout=120, env=env)

    keyed, refused = chat("--api-key", "key-bolt"), chat()
    assert keyed.returncode == 0, keyed.stderr
    assert keyed.stdout == f"{expected}\n"
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("tandem chat: HTTP 401: "), refused.stderr


def test_startup_progress_goes_to_stderr(cluster: UpProcess) -> None:
    err = cluster.log_path.read_text()
    assert re.search(r"^\d\d:\d\d:\d\d INFO Ray is up in [\d.]+ s", err, re.M), err
    assert re.search(r"INFO gateway: replica 1/1 up: engine loaded SmolLM2-135M-Instruct "
                     r"\(built-in\) in [\d.]+ s$", err, re.M), err
    assert "Tandem ready" not in err  # the ready line is stdout's alone


def _stats_lines(cluster: UpProcess) -> list[re.Match[str]]:
    return [m for m in map(STATS.search, cluster.log_path.read_text().splitlines()) if m]


def _total(cluster: UpProcess, name: str) -> float:
    return sum(scrape(cluster, name).values())


def test_stats_line_matches_metrics(cluster: UpProcess) -> None:
    before = len(_stats_lines(cluster))
    prompt = "Tandem prints a line of stats every interval in which something changed."
    with httpx.Client(base_url=cluster.http_url, timeout=60,
                      headers={"authorization": "Bearer key-bolt"}) as http:
        for _ in range(3):  # the same prompt: the 2nd and 3rd hit the prefix cache
            response = http.post("/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8,
                "temperature": 0})
            assert response.status_code == 200, response.text
    # Idle now: /metrics holds still, and the next stats line (within an interval) shows it.
    ended = _total(cluster, "tandem_request_success_total")
    assert ended >= 3

    def settled() -> bool:
        lines = _stats_lines(cluster)
        return len(lines) > before and int(lines[-1].group(7)) == ended

    wait_for(settled, 10 * STATS_INTERVAL_S, "a stats line with every request ended")
    last = _stats_lines(cluster)[-1]
    kv = list(scrape(cluster, "tandem_kv_cache_usage_perc").values())
    assert len(kv) == 1
    assert last.group(1, 2) == ("0", "0")
    assert _total(cluster, "tandem_num_requests_running") == 0
    assert _total(cluster, "tandem_num_requests_waiting") == 0
    assert last.group(5) == f"{100 * kv[0]:.1f}"
    assert int(last.group(8)) == _total(cluster, "tandem_prompt_tokens_total")
    assert int(last.group(9)) == _total(cluster, "tandem_generation_tokens_total")
    # The lines since the requests began: their rates cover the tokens that ended meanwhile.
    new = _stats_lines(cluster)[before:]
    assert any(float(m.group(3)) > 0 for m in new) and any(float(m.group(4)) > 0 for m in new)
    assert any(m.group(6) != "-" for m in new)  # prompt tokens were looked up in the cache
    # Nothing changes while idle, so nothing more is printed (a negative: waited out, not synced).
    time.sleep(3 * STATS_INTERVAL_S)
    assert len(_stats_lines(cluster)) == before + len(new)
