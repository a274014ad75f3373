"""Streams survive a decode worker: migration with exact continuation.

`tandem up` with 1 prefill and 2 decode workers (TCP). 16 concurrent streams, half greedy and
half seeded sampling at temperature 0.8, run once undisturbed and once while one decode replica
is killed with SIGKILL mid-stream: every stream completes without an error event and with
exactly the tokens of its undisturbed run (the gateway resumes it on the other decode worker
with the tokens it already sent; draws depend only on the seed and the token's position).
With SIGTERM instead, Serve drains the replica: its streams finish there, then it exits.
With SIGSTOP (a hung worker), the streams stall and move on (the stream idle timeout or Serve's
health check, whichever comes first). Churn: closed-loop clients while a decode replica is
SIGKILLed every 10 s and replaced by Serve: no request fails, every output is exact.
Seeded sampling through the cluster equals the engine's own, colocated, output (a JSON-schema
stream and one with every logits control among them, so these survive migration too). A prefill
worker killed after its first token, before the decode worker's pull, costs a recompute on
the decode worker, not the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tandem.services.protocol.request import SamplingParams, StructuredOutput
from tests.e2e.cluster import UpProcess, all_blocks_free, metric_values, per_worker, wait_for

# A decode stream silent for 8 s is a hung worker (Serve's health check kills one after ~10 s).
SETTINGS = {"prefill_replicas": 1, "decode_replicas": 2, "kv_transport": "tcp",
            "stream_idle_timeout_s": 8}
SIGKILL_SEED = 669  # the prefill worker kills itself when D comes for this request's KV
POISON_SEED = 4242  # a decode engine's step that runs this request fails fatally (as a device)
PROMPTS = ["Write one sentence about the sea.", "Name three rivers in Europe.",
           "Describe a lighthouse at night.", "What is a prime number?",
           "Give advice to a new gardener.", "Tell a short story about a cat.",
           "Explain rain to a child.", "List some uses of copper."]
MAX_TOKENS = 40
STREAMS = 2 * len(PROMPTS)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = UpProcess.from_settings(Path(tmp_path_factory.mktemp("migration")), SETTINGS,
                                 {"TANDEM_TEST_FAULTS": f"prefill:sigkill={SIGKILL_SEED},"
                                                        f"decode:fatal={POISON_SEED}"}).start()
    try:
        yield up
    finally:
        up.stop()


# A JSON schema (greedy stream 7: the output is still unfinished JSON at MAX_TOKENS) and the
# logits controls (sampled stream 15): a migrated stream's new worker rebuilds its grammar state
# and penalties from the tokens already sent, and goes on exactly.
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 30}
CONTROLS: dict[int, dict[str, object]] = {
    7: {"structured_outputs": {"json": WORDS}},
    15: {"frequency_penalty": 0.8, "presence_penalty": 0.3, "repetition_penalty": 1.2,
         "min_p": 0.05, "logit_bias": {"13": -5.0}},
}


def _body(i: int) -> dict[str, object]:
    """Streams 0-7 greedy, 8-15 seeded sampling, over the 8 prompts (two with CONTROLS)."""
    sampling: dict[str, object] = ({"temperature": 0} if i < len(PROMPTS)
                                   else {"temperature": 0.8, "top_p": 0.95, "seed": 100 + i})
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "return_token_ids": True, **sampling, **CONTROLS.get(i, {})}


def _params(i: int) -> SamplingParams:
    """``_body(i)`` as the engine's parameters."""
    body = _body(i)
    controls = CONTROLS.get(i, {})
    return SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, temperature=float(body["temperature"]),  # type: ignore[arg-type]
        top_p=float(body.get("top_p", 1.0)), seed=body.get("seed"),  # type: ignore[arg-type]
        structured_output=(StructuredOutput("json", json.dumps(WORDS))
                           if "structured_outputs" in controls else None),
        frequency_penalty=float(controls.get("frequency_penalty", 0.0)),  # type: ignore[arg-type]
        presence_penalty=float(controls.get("presence_penalty", 0.0)),  # type: ignore[arg-type]
        repetition_penalty=float(controls.get("repetition_penalty", 1.0)),  # type: ignore[arg-type]
        min_p=float(controls.get("min_p", 0.0)),  # type: ignore[arg-type]
        logit_bias=tuple((int(k), v) for k, v in controls.get("logit_bias", {}).items()))  # type: ignore[attr-defined]


Progress = list[int]


async def _stream(http: httpx.AsyncClient, i: int, progress: Progress | None = None
                  ) -> list[int]:
    """Request ``_body(i)``'s streamed token ids (no error event allowed)."""
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json=_body(i)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, (i, chunk)
            tokens += chunk["choices"][0]["token_ids"]
            if progress is not None:
                progress[i] = len(tokens)
    return tokens


async def _run_streams(cluster: UpProcess,
                       during: Callable[[Progress], Awaitable[None]] | None = None
                       ) -> list[list[int]]:
    progress = [0] * STREAMS
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300,
                                 limits=httpx.Limits(max_connections=STREAMS)) as http:
        streams = [asyncio.ensure_future(_stream(http, i, progress)) for i in range(STREAMS)]
        if during is not None:
            await during(progress)
        return list(await asyncio.gather(*streams))


def _decode_replicas(cluster: UpProcess) -> list[psutil.Process]:
    return [p for p in cluster.descendants()
            if "ServeReplica" in " ".join(p.cmdline()) and ":decode" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def undisturbed(cluster: UpProcess) -> list[list[int]]:
    return asyncio.run(_run_streams(cluster))


def test_seeded_sampling_through_the_cluster_equals_the_engine(
        undisturbed: list[list[int]], make_engine, loaded_model) -> None:  # type: ignore[no-untyped-def]
    prompts = [loaded_model.tokenizer.encode(str(_body(i)["prompt"])) for i in range(STREAMS)]
    params = [_params(i) for i in range(STREAMS)]
    # One batch: each request's draws depend on its seed and positions, not on its batch.
    expected = make_engine().generate(prompts, params)
    for i in range(STREAMS):
        assert expected[i] == undisturbed[i], i
    assert len(set(map(tuple, undisturbed[len(PROMPTS):]))) == len(PROMPTS)  # samples differ
    text = loaded_model.tokenizer.decode(undisturbed[7])
    assert text.startswith('["') and len(text) > 40, text  # held to the schema


def test_a_session_stays_on_its_decode_worker(cluster: UpProcess,
                                              undisturbed: list[list[int]]) -> None:
    """Six turns of a conversation named by prompt_cache_key: the router keeps them on one of
    the two decode workers (the idle cluster's loads stay within the slack)."""
    def routes() -> dict[str, float]:
        return {dict(labels)["outcome"]: value for labels, value in metric_values(
            cluster.http_url, "tandem_router_session_routes_total").items()}

    before = routes()
    messages: list[dict[str, str]] = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"Turn {turn}: name a colour."})
        response = httpx.post(f"{cluster.http_url}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 8, "temperature": 0,
            "prompt_cache_key": "e2e-session"})
        assert response.status_code == 200, response.text
        messages.append({"role": "assistant",
                         "content": response.json()["choices"][0]["message"]["content"]})
    after = routes()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("new", "kept", "moved")} == {
        "new": 1, "kept": 5, "moved": 0}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP],
                         ids=["sigkill", "sigterm", "sigstop"])
def test_a_lost_decode_worker_does_not_cut_a_stream(cluster: UpProcess,
                                                    undisturbed: list[list[int]],
                                                    sig: signal.Signals) -> None:
    before = sum(metric_values(cluster.http_url, "tandem_request_migrations_total").values())
    replicas = _decode_replicas(cluster)
    assert len(replicas) == 2, [p.cmdline() for p in replicas]

    async def kill_mid_stream(progress: Progress) -> None:
        while min(progress) < 4:  # every stream has tokens out, none has finished
            await asyncio.sleep(0.02)
        replicas[0].send_signal(sig)

    migrated = asyncio.run(_run_streams(cluster, kill_mid_stream))
    for i in range(STREAMS):
        assert migrated[i] == undisturbed[i], i
    after = sum(metric_values(cluster.http_url, "tandem_request_migrations_total").values())
    if sig == signal.SIGTERM:  # Serve drains the replica (its streams finish there), then it exits
        replicas[0].wait(timeout=120)
    else:  # some streams were on the killed (or hung) worker: they moved
        assert after > before
    if sig == signal.SIGSTOP:  # Serve's health check may have killed it by now; if not, resume it
        with contextlib.suppress(psutil.NoSuchProcess):
            replicas[0].send_signal(signal.SIGCONT)
    resumed = metric_values(cluster.http_url, "tandem_migration_resume_seconds_count")
    assert sum(resumed.values()) == after
    # Serve replaces the lost replica; then every block is free on all three workers.
    wait_for(lambda: len(_decode_replicas(cluster)) == 2 and all_blocks_free(cluster, 3), 240,
             "the replacement decode worker and every KV block free")


CHURN_KILLS, CHURN_EVERY_S, CHURN_CLIENTS = 2, 10.0, 8


def test_streams_survive_decode_workers_killed_every_10_s(
        cluster: UpProcess, undisturbed: list[list[int]]) -> None:
    """Closed-loop clients over the 16 bodies while a decode replica is SIGKILLed every 10 s
    (each time once Serve has replaced the previous one): every request completes, exactly."""
    before = sum(metric_values(cluster.http_url, "tandem_request_migrations_total").values())
    kills: list[int] = []
    done: list[tuple[int, list[int]]] = []

    def replaced() -> bool:  # both decode workers up and reporting (with the prefill worker),
        # each with streams in flight, so the kill has streams to migrate (a kill that found a
        # just-replaced worker still idle once migrated none, and the count below failed)
        blocks = metric_values(cluster.http_url, "tandem_kv_cache_blocks")
        if len(_decode_replicas(cluster)) != 2 or len(blocks) != 3:
            return False
        running = per_worker(metric_values(cluster.http_url, "tandem_num_requests_running"))
        decode = [dict(labels)["worker"] for labels in
                  metric_values(cluster.http_url, "tandem_worker_info")
                  if dict(labels)["role"] == "decode"]
        return len(decode) == 2 and all(running.get(w, 0) > 0 for w in decode)

    async def killer() -> None:
        for _ in range(CHURN_KILLS):
            await asyncio.sleep(CHURN_EVERY_S)
            while not await asyncio.to_thread(replaced):
                await asyncio.sleep(0.5)
            victim = _decode_replicas(cluster)[len(kills) % 2]
            victim.send_signal(signal.SIGKILL)
            kills.append(victim.pid)

    async def client(http: httpx.AsyncClient, first: int, stop: asyncio.Task[None]) -> None:
        i = first
        while not stop.done():
            done.append((i, await _stream(http, i)))
            i = (i + CHURN_CLIENTS) % STREAMS

    async def run() -> None:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300) as http:
            stop = asyncio.ensure_future(killer())
            await asyncio.gather(*(client(http, c, stop) for c in range(CHURN_CLIENTS)), stop)

    asyncio.run(run())
    assert len(kills) == CHURN_KILLS
    for i, tokens in done:
        assert tokens == undisturbed[i], i
    after = sum(metric_values(cluster.http_url, "tandem_request_migrations_total").values())
    assert after > before
    wait_for(lambda: len(_decode_replicas(cluster)) == 2 and all_blocks_free(cluster, 3), 240,
             "the replacement decode worker and every KV block free")


def test_a_prefill_worker_killed_before_the_pull_costs_a_recompute(
        cluster: UpProcess, make_engine, loaded_model) -> None:  # type: ignore[no-untyped-def]
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=SIGKILL_SEED, ignore_eos=True)
    expected = make_engine().generate([loaded_model.tokenizer.encode(prompt)], params)[0]
    recomputes = sum(metric_values(cluster.http_url, "tandem_decode_recomputes_total").values())
    response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 16, "temperature": 0.8, "seed": SIGKILL_SEED,
        "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected
    wait_for(lambda: sum(metric_values(cluster.http_url, "tandem_decode_recomputes_total")
                         .values()) > recomputes, 30, "the decode worker's recompute counted")
    # Serve replaces the prefill replica; then every block is free on all three workers.
    wait_for(lambda: all_blocks_free(cluster, 3), 240, "every KV block free")


def test_a_poison_request_fails_instead_of_killing_every_decode_worker(
        cluster: UpProcess) -> None:
    """A request whose step brings down each decode engine it reaches: the first failure sends
    it on (it may have been a bystander), the second fails it with a clear 500 instead of
    moving it to the next replacement; then both workers are back, every block free, and the
    next request is served. Meanwhile the admission limit (``max_in_flight`` unset: a decode
    batch, 32, per healthy decode worker) falls to one batch and comes back to two. (Last in
    the module: it stops both decode engines.)"""

    def limit() -> float:
        values = list(metric_values(cluster.http_url, "tandem_requests_in_flight_limit").values())
        assert len(values) == 1, values
        return values[0]

    failures = sum(metric_values(cluster.http_url, "tandem_request_failures_total").values())
    response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
        "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.8, "seed": POISON_SEED})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_error"
    assert "the 2 decode workers that ran this request all failed" in error["message"]
    assert sum(metric_values(cluster.http_url, "tandem_request_failures_total").values()) == \
        failures + 1
    wait_for(lambda: limit() == 32, 30, "one decode batch while no decode worker is healthy")

    def replaced() -> bool:  # two healthy decode workers (new ones), every block free
        healthy = metric_values(cluster.http_url, "tandem_worker_healthy")
        decode = [v for labels, v in healthy.items() if dict(labels)["role"] == "decode"]
        return decode == [1.0, 1.0] and all_blocks_free(cluster, 3)

    wait_for(replaced, 240, "both decode workers replaced and every KV block free")
    wait_for(lambda: limit() == 64, 30, "a decode batch admitted per healthy decode worker")

    def served() -> bool:
        """The next request served; until the router routes to the new workers (a window
        after the health metric shows them), a retryable 503 and nothing else."""
        response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
            "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
        assert response.status_code in (200, 503), response.text
        assert response.status_code == 200 or "retry shortly" in response.text, response.text
        return response.status_code == 200

    wait_for(served, 60, "the next request served by a new decode worker")
