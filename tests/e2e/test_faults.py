"""Failure semantics end to end: real faults in real worker processes of one `tandem up`.

The faults are raised inside the workers by the test-only hook (``TANDEM_TEST_FAULTS``,
services/engine/faults.py), keyed by a request's seed: a failed engine step, a fatal engine
fault (as a CUDA error), and a prefill worker that SIGSTOPs itself after sending its result,
when the decode worker pairs with it or confirms its KV pull. Each test ends
with every KV block free on every worker and a normal request served.

The tests run in file order on one cluster; the fatal fault (the decode replica is replaced)
comes last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import (
    UpProcess,
    all_blocks_free,
    metric_values,
    resume_stopped_worker,
    wait_for,
)

STEP_SEED, FATAL_SEED, SIGSTOP_SEED = 666, 667, 668
SETTINGS = {
    "prefill_replicas": 1, "decode_replicas": 1, "kv_transport": "tcp",
    "prefill_timeout_s": 10.0, "control_timeout_s": 5.0, "kv_transfer_timeout_s": 3.0,
    "stream_idle_timeout_s": 20.0, "request_timeout_s": 90.0, "lease_ttl_s": 5.0,
    "max_in_flight": 6,
    # A replica being replaced waits this long for its calls: longer than the test waits for
    # the old decode replica to go (a gateway's idle channel to it must not hold it).
    "drain_timeout_s": 60.0,
}
PROMPT = "Write one sentence about the sea."
MAX_TOKENS = 16

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    faults = f"step={STEP_SEED},decode:fatal={FATAL_SEED},prefill:sigstop={SIGSTOP_SEED}"
    up = UpProcess.from_settings(Path(tmp_path_factory.mktemp("faults")), SETTINGS,
                                 {"TANDEM_TEST_FAULTS": faults}).start()
    try:
        yield up
    finally:
        for proc in up.descendants():  # a worker left stopped by a failed test
            if proc.status() == psutil.STATUS_STOPPED:
                proc.send_signal(signal.SIGCONT)
        up.stop()


@pytest.fixture(scope="module")
def client(cluster: UpProcess) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0,
                  timeout=120)


@pytest.fixture(scope="module")
def expected(make_engine) -> list[int]:  # type: ignore[no-untyped-def]
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], params)[0]


def _complete(cluster: UpProcess, **extra: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=120)


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])



def _served_normally(cluster: UpProcess, expected: list[int]) -> None:
    """Every block free again, then a normal request is served, exactly."""
    # Up to a replica's replacement: a worker stopped past its health check is replaced.
    wait_for(lambda: all_blocks_free(cluster), 90, "every KV block free on both workers")
    assert _tokens(_complete(cluster)) == expected


def _failures(cluster: UpProcess, reason: str) -> float:
    values = metric_values(cluster.http_url, "tandem_request_failures_total")
    return sum(v for k, v in values.items() if dict(k)["reason"] == reason)


def _decode_metric(cluster: UpProcess, name: str) -> float:
    return sum(metric_values(cluster.http_url, name).values())


def _recomputed(cluster: UpProcess, before: float) -> None:
    """D counted the recompute (its metrics reach /metrics with the next status poll)."""
    wait_for(lambda: _decode_metric(cluster, "tandem_decode_recomputes_total") > before,
             10, "the decode worker's recompute on /metrics")



def test_prefill_worker_hung_during_pairing_recomputes_on_decode(cluster: UpProcess,
                                                                 expected: list[int]) -> None:
    """The cluster's first request: P answers, then hangs before D has paired with it. D's
    pairing times out (control_timeout_s), D recomputes the prompt: the exact output."""
    recomputes = _decode_metric(cluster, "tandem_decode_recomputes_total")
    response = _complete(cluster, seed=SIGSTOP_SEED)
    resume_stopped_worker(cluster)  # soon: Serve replaces a replica hung past its health check
    assert _tokens(response) == expected
    _recomputed(cluster, recomputes)
    _served_normally(cluster, expected)


def test_prefill_worker_hung_during_the_kv_pull(cluster: UpProcess, expected: list[int]) -> None:
    """Paired now: P hangs when D confirms the pull (the lease's release), so D cannot vouch
    for the blocks it read and recomputes; a stream already decoding on D is not held up."""
    async def run() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as http:
            body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            bystander = asyncio.ensure_future(http.post("/v1/completions", json=body))
            hung = await http.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "seed": SIGSTOP_SEED, "return_token_ids": True})
            resume_stopped_worker(cluster)
            return _tokens(hung), _tokens(await bystander)

    recomputes = _decode_metric(cluster, "tandem_decode_recomputes_total")
    hung, bystander = asyncio.run(run())
    assert hung == expected
    assert bystander[:MAX_TOKENS] == expected[:MAX_TOKENS] and len(bystander) == 200
    _recomputed(cluster, recomputes)
    _served_normally(cluster, expected)


def test_a_failed_engine_step_fails_only_its_request(cluster: UpProcess,
                                                    expected: list[int]) -> None:
    before = _failures(cluster, "engine_error")
    response = _complete(cluster, seed=STEP_SEED)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "engine_error" and "injected step fault" in error["message"]
    assert _failures(cluster, "engine_error") == before + 1
    _served_normally(cluster, expected)


def test_the_deadline_ends_a_request_with_504(cluster: UpProcess, client: OpenAI,
                                              expected: list[int]) -> None:
    before = _failures(cluster, "timeout")
    long = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "timeout": 1.0}
    response = httpx.post(f"{cluster.http_url}/v1/completions", json=long, timeout=60)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "timeout"
    # Streaming: the 200 went out, so the deadline ends the stream with an error event (a
    # longer deadline, so that the first token is out before it even on a loaded machine).
    events = []
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions",
                      json={**long, "stream": True, "timeout": 8.0}, timeout=60) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "timeout"
    assert events[-1] == "data: [DONE]"
    assert _failures(cluster, "timeout") == before + 2
    _served_normally(cluster, expected)


def test_overload_is_shed_with_429_before_any_token(cluster: UpProcess,
                                                    expected: list[int]) -> None:
    """6 requests may be in flight; 30 at once: the rest get 429 + Retry-After before any
    200, and every admitted stream completes without an error event."""
    async def one(http: httpx.AsyncClient) -> tuple[int, str | None, list[str]]:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
            return response.status_code, response.headers.get("retry-after"), lines

    async def burst() -> list[tuple[int, str | None, list[str]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120,
                                     limits=limits) as http:
            return await asyncio.gather(*(one(http) for _ in range(30)))

    results = asyncio.run(burst())
    admitted = [lines for status, _, lines in results if status == 200]
    shed = [(retry, lines) for status, retry, lines in results if status == 429]
    assert len(admitted) + len(shed) == len(results)
    assert admitted and shed
    for retry, lines in shed:
        assert retry is not None and int(retry) >= 1
        assert "server_overloaded" in lines[0]
    for lines in admitted:
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    _served_normally(cluster, expected)


def test_a_fatal_engine_fault_replaces_the_replica(cluster: UpProcess,
                                                   expected: list[int]) -> None:
    """D's engine stops (as on a CUDA error): the request fails clearly, /health says 503
    while no decode worker is healthy, Serve replaces the replica, and requests are served
    again (the time to the first one is printed for the closing note)."""
    faulted = time.monotonic()
    response = _complete(cluster, seed=FATAL_SEED)
    assert response.status_code == 503, response.text
    assert "injected fatal fault" in response.json()["error"]["message"]
    assert response.headers["retry-after"]

    def health() -> int:
        return httpx.get(f"{cluster.http_url}/health", timeout=10).status_code

    wait_for(lambda: health() == 503, 30, "/health to say 503")
    wait_for(lambda: health() == 200, 240, "the replacement decode replica")
    _served_normally(cluster, expected)
    print(f"\nfatal fault -> first request served by the replacement: "
          f"{time.monotonic() - faulted:.1f} s")
    assert os.environ.get("TANDEM_TEST_FAULTS") is None  # the hook stayed in the cluster


def _decode_replicas(cluster: UpProcess) -> list[psutil.Process]:
    replicas = []
    for proc in cluster.descendants():
        try:
            command = " ".join(proc.cmdline())
            exiting = proc.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:  # exited meanwhile
            continue
        if "ServeReplica" in command and ":decode" in command and not exiting:
            replicas.append(proc)
    return replicas


def _decode_replica(cluster: UpProcess) -> psutil.Process:
    """The one decode replica process, once a replaced one has gone: the gateway closed its
    idle channel to it (else it would wait out drain_timeout_s for that call)."""
    wait_for(lambda: len(_decode_replicas(cluster)) == 1, 40,
             "the replaced decode replica's process to exit")
    return _decode_replicas(cluster)[0]


@pytest.mark.timeout(600)  # two replacements on a slow machine
def test_a_killed_decode_replica_ends_its_streams_clearly(cluster: UpProcess,
                                                          expected: list[int]) -> None:
    """SIGKILL of the decode replica mid-stream: the stream ends with an error event (never
    hangs), new requests get a clear status (503 while no decode worker is left), and the
    replacement serves exactly, with every block free."""
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body,
                      timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        while not next(lines).startswith("data: "):  # decoding has started
            pass
        _decode_replica(cluster).kill()
        events = [line for line in lines if line.startswith("data: ")]
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "unavailable" and "died" in error["message"], error
    assert events[-1] == "data: [DONE]"

    def answered() -> bool:
        # A request sent before the gateway found the replica dead may wait out a hop's
        # timeout (504); after that, 503 until the replacement serves.
        response = _complete(cluster)
        assert response.status_code in (200, 503, 504), response.text
        return response.status_code == 200

    wait_for(answered, 240, "a request served by the replacement decode replica")
    _served_normally(cluster, expected)
