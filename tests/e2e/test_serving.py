"""End to end on a real local Ray Serve cluster started by `tandem up` (1 prefill, 1 decode)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from openai import AsyncOpenAI, OpenAI

from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.protocol.request import SamplingParams
from tests.e2e.cluster import (
    TANDEM,
    UpProcess,
    all_blocks_free,
    free_port,
    metric_values,
    per_worker,
    resume_stopped_worker,
    wait_for,
)
from tests.e2e.conftest import HUNG_PREFILL_SEED

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24
TOKEN_IDS = {"return_token_ids": True}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(make_engine):  # type: ignore[no-untyped-def]
    """The engine's own output for a prompt's token ids (greedy unless told otherwise)."""
    engine = make_engine()

    def greedy(prompt: list[int], max_tokens: int = MAX_TOKENS, **kw: object) -> list[int]:
        params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **kw})  # type: ignore[arg-type]
        return engine.generate([prompt], params)[0]

    return greedy


@pytest.fixture(scope="module")
def client(cluster: UpProcess) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0,
                  timeout=120)


def _tokens(obj: object) -> list[int]:
    return list(obj.model_extra["token_ids"])  # type: ignore[attr-defined]


def test_chat_matches_engine(client: OpenAI, reference) -> None:  # type: ignore[no-untyped-def]
    response = client.chat.completions.create(model=MODEL, messages=QUESTION,  # type: ignore[arg-type]
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body=TOKEN_IDS)
    prompt = list(response.model_extra["prompt_token_ids"])
    want = reference(prompt)
    got = _tokens(response.choices[0])
    assert got == want
    assert "Paris" in (response.choices[0].message.content or "")
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(want)
    assert response.usage.total_tokens == len(prompt) + len(want)

    stream = client.chat.completions.create(model=MODEL, messages=QUESTION,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=TOKEN_IDS)
    streamed, text, usage = [], "", None
    for chunk in stream:
        if chunk.choices:
            streamed += chunk.choices[0].model_extra.get("token_ids") or []
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert streamed == want
    assert text == response.choices[0].message.content
    assert usage is not None and usage.completion_tokens == len(want)


def test_completion_matches_engine(client: OpenAI, reference) -> None:  # type: ignore[no-untyped-def]
    prompt = "The three primary colours are"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={**TOKEN_IDS,
                                                                    "ignore_eos": True})
    prompt_ids = list(response.model_extra["prompt_token_ids"])
    want = reference(prompt_ids, ignore_eos=True)
    assert _tokens(response.choices[0]) == want
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        len(prompt_ids), MAX_TOKENS)
    assert response.choices[0].finish_reason == "length"

    streamed, text = [], ""
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={**TOKEN_IDS, "ignore_eos": True}):
        if chunk.choices:
            streamed += chunk.choices[0].model_extra.get("token_ids") or []
            text += chunk.choices[0].text
    assert streamed == want
    assert text == response.choices[0].text


def _spec_counts(cluster: UpProcess) -> tuple[float, float]:
    drafts = metric_values(cluster.http_url, "tandem_spec_decode_draft_tokens_total")
    accepted = metric_values(cluster.http_url, "tandem_spec_decode_accepted_tokens_total")
    return sum(drafts.values()), sum(accepted.values())


def test_speculative_decoding_on_the_decode_worker(client: OpenAI, cluster: UpProcess,
                                                   reference) -> None:  # type: ignore[no-untyped-def]
    """A prompt whose continuation copies from it: the decode worker's n-gram drafts are
    accepted, and the tokens are still exactly plain greedy decoding's."""
    passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen "
               "liquor jugs. How vexingly quick daft zebras jump! ")
    prompt = passage * 3 + "The quick brown"
    extra = {**TOKEN_IDS, "ignore_eos": True}
    wait_for(lambda: all_blocks_free(cluster), 30, "an idle cluster")
    before = _spec_counts(cluster)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32,
                                         temperature=0, extra_body=extra)
    want = reference(list(response.model_extra["prompt_token_ids"]), 32, ignore_eos=True)
    assert _tokens(response.choices[0]) == want
    wait_for(lambda: _spec_counts(cluster)[1] > before[1], 30, "accepted draft tokens")
    after = _spec_counts(cluster)
    assert after[0] > before[0]
    # Opting out per request: same tokens, no drafts.
    wait_for(lambda: all_blocks_free(cluster), 30, "an idle cluster")
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32,
                                         temperature=0, extra_body={**extra,
                                                                    "speculative": False})
    assert _tokens(response.choices[0]) == want
    wait_for(lambda: all_blocks_free(cluster), 30, "an idle cluster")
    assert _spec_counts(cluster) == after


def test_seeded_sampling_equals_the_engine_on_the_reference_set(
        cluster: UpProcess, prompts: list[list[int]], reference) -> None:  # type: ignore[no-untyped-def]
    """Seeded sampling (temperature 0.8, top-p 0.95) through P, the NIXL pull and a decode
    worker that speculates: the tokens the engine alone samples for the same seeds (draws
    depend only on the seed and the token's position; verification accepts only drafts that
    equal the target's own draws). Half the set (every other prompt) keeps CI short; the
    structured-output test below samples through the cluster too."""
    prompts = prompts[::2]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 16, "temperature": 0.8, "top_p": 0.95,
                "seed": 1000 + i, "ignore_eos": True, "return_token_ids": True})
                for i, prompt in enumerate(prompts)))
        for response in responses:
            assert response.status_code == 200, response.text
        return [list(r.json()["choices"][0]["token_ids"]) for r in responses]

    sampled = asyncio.run(run())
    for i, prompt in enumerate(prompts):
        assert sampled[i] == reference(prompt, 16, ignore_eos=True, temperature=0.8,
                                       top_p=0.95, seed=1000 + i), i
    assert len({tuple(tokens) for tokens in sampled}) == len(prompts)


def test_logits_controls_through_prefill_and_a_speculating_decode_worker(
        cluster: UpProcess, client: OpenAI, reference) -> None:  # type: ignore[no-untyped-def]
    """Penalties, logit_bias, min_tokens and min_p travel with the request to the prefill
    worker (the first token) and the decode worker, which speculates (each drafted position
    sees the drafts before it): the engine's own tokens for the same parameters."""
    messages = [{"role": "user", "content": "Write the word 'the' five times."}]
    tokenized = httpx.post(f"{cluster.http_url}/tokenize", json={"messages": messages},
                           timeout=30)
    prompt = tokenized.json()["tokens"]
    cases = [  # (HTTP fields, the same as SamplingParams fields)
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.2},
         {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.2}),
        ({"logit_bias": {"504": -100.0}, "min_tokens": 20, "stop_token_ids": [198]},
         {"logit_bias": ((504, -100.0),), "min_tokens": 20, "stop_token_ids": (198,)}),
        ({"min_p": 0.1, "frequency_penalty": 1.0},
         {"min_p": 0.1, "frequency_penalty": 1.0, "temperature": 0.9, "seed": 21}),
    ]
    for fields, params in cases:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            temperature=params.get("temperature", 0), seed=params.get("seed"),
            extra_body={**fields, **TOKEN_IDS})
        tokens = _tokens(response.choices[0])
        assert tokens == reference(prompt, **params), fields
        assert tokens != reference(prompt, **{k: v for k, v in params.items()
                                              if k in ("temperature", "seed")}), fields


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def test_structured_output_through_prefill_and_a_speculating_decode_worker(
        cluster: UpProcess, prompts: list[list[int]], reference) -> None:  # type: ignore[no-untyped-def]
    """A JSON schema on 20 requests (half greedy, half sampled), a regex and a choice: the
    prefill worker masks the first token, the decode worker (which speculates: drafts are
    checked against the grammar) the rest; every output holds and equals the engine's own."""
    from tandem.services.protocol.request import StructuredOutput

    schema = StructuredOutput("json", json.dumps(PERSON))
    cases = [(prompts[i % len(prompts)], {"structured_outputs": {"json": PERSON}},
              {"structured_output": schema, **({"temperature": 0.9, "seed": 500 + i}
                                                if i % 2 else {})})
             for i in range(20)]
    cases += [(prompts[0], {"guided_regex": "[a-z]+-[0-9]{3}"},
               {"structured_output": StructuredOutput("regex", "[a-z]+-[0-9]{3}")}),
              (prompts[1], {"guided_choice": ["alpha", "beta gamma"]},
               {"structured_output": StructuredOutput("choice", '["alpha", "beta gamma"]')})]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 48, "temperature": params.get("temperature", 0),
                "seed": params.get("seed"), "return_token_ids": True, **fields})
                for prompt, fields, params in cases))
        for response in responses:
            assert response.status_code == 200, response.text
        return [r.json()["choices"][0] for r in responses]

    import jsonschema

    choices = asyncio.run(run())
    for choice in choices[:20]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), PERSON)
    assert re.fullmatch("[a-z]+-[0-9]{3}", choices[20]["text"])
    assert choices[21]["text"] in ("alpha", "beta gamma")
    checked = [*range(0, 20, 5), *range(1, 20, 5), 20, 21]  # greedy and sampled, all kinds
    for i in checked:
        prompt, _, params = cases[i]
        assert choices[i]["token_ids"] == reference(prompt, 48, **params), i


def test_n_choices_prefill_the_prompt_once(cluster: UpProcess, reference) -> None:  # type: ignore[no-untyped-def]
    """n = 4 with a seed through P and D: each choice equals the engine's output for seed +
    its index, and the prompt is computed once: the other three choices find its full blocks
    cached, on P (or, if the router saw them on D first, on D, skipping P)."""
    block = 16
    prompt = [3000 + 7 * i for i in range(5 * block + 3)]  # no other test sends these tokens
    full = (len(prompt) - 1) // block * block

    def prefill_counts() -> tuple[float, float, float]:
        roles = {dict(k)["worker"]: dict(k)["role"]
                 for k in metric_values(cluster.http_url, "tandem_kv_cache_blocks")}

        def on_prefill(name: str) -> float:
            return sum(v for w, v in per_worker(metric_values(cluster.http_url, name)).items()
                       if roles.get(w) == "prefill")

        skipped = sum(v for k, v in metric_values(cluster.http_url,
                                                  "tandem_router_decisions_total").items()
                      if dict(k)["reason"] == "skip_prefill")
        return (on_prefill("tandem_prefix_cache_queries_total"),
                on_prefill("tandem_prefix_cache_hits_total"), skipped)

    wait_for(lambda: all_blocks_free(cluster), 30, "an idle cluster")
    before = prefill_counts()
    response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 77, "n": 4,
        "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for i, choice in enumerate(choices):
        assert choice["token_ids"] == reference(prompt, 8, ignore_eos=True, temperature=1.0,
                                                seed=77 + i), i
    wait_for(lambda: all_blocks_free(cluster), 30, "every block free after the choices")
    queries, hits, skipped = (a - b for a, b in zip(prefill_counts(), before, strict=True))
    on_p = round(queries / len(prompt)) - 1  # choices after the first that P prefilled
    assert queries == (1 + on_p) * len(prompt), (queries, hits, skipped)
    assert hits == on_p * full, (queries, hits, skipped)
    assert on_p + skipped == 3, (queries, hits, skipped)


def test_a_repeated_prompt_reports_its_cached_tokens(cluster: UpProcess) -> None:
    """The same prompt twice: the second finds its full blocks cached, on P or (the router
    skipping P for a prefix cached on D) on D, and its usage says so either way."""
    block = 16
    prompt = [3500 + 11 * i for i in range(6 * block + 5)]  # no other test sends these tokens
    usages = []
    for _ in range(2):
        response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
        wait_for(lambda: all_blocks_free(cluster), 30, "every block free after the request")
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 6 * block, usages


def test_echo_with_logprobs_through_prefill_and_decode(cluster: UpProcess, client: OpenAI,
                                                      make_engine) -> None:  # type: ignore[no-untyped-def]
    """The prompt's logprobs are computed by the prefill worker and reach the client with the
    completion's: the engine's own values."""
    from tests.engine.helpers import outputs

    prompt = [1, 504, 3458, 282, 4649, 314, 1552, 28, 253, 1345]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                         temperature=0, logprobs=1, echo=True)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    engine = make_engine(num_kv_blocks=64)
    want = outputs(engine, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                  prompt_logprobs=1))[0].prompt_logprobs
    assert want is not None
    assert logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
        [lp.logprob for lp in want], abs=1e-4)
    assert len(logprobs.token_logprobs) == len(prompt) + 4


def test_grpc_streams_same_tokens(cluster: UpProcess, client: OpenAI,
                                  reference) -> None:  # type: ignore[no-untyped-def]
    prompt = [1, 504, 3458, 282, 4649, 314]  # token ids: no tokenizer in the way
    want = reference(prompt, ignore_eos=True)
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingOptions(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        responses = list(stub.Generate(request, timeout=120))
        assert [t for r in responses for t in r.token_ids] == want
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == MAX_TOKENS
        assert len(responses) > 2  # streamed, not one message at the end

        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "tandem.v1.Generation" in services


def test_sixteen_concurrent_streams(cluster: UpProcess, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]

    async def one(client: AsyncOpenAI, prompt: str) -> tuple[list[int], list[int], str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            extra_body={**TOKEN_IDS, "ignore_eos": True})
        tokens, prompt_ids, finish = [], [], None
        async for chunk in stream:
            extra = chunk.model_extra or {}
            prompt_ids = extra.get("prompt_token_ids") or prompt_ids
            if chunk.choices:
                tokens += chunk.choices[0].model_extra.get("token_ids") or []
                finish = chunk.choices[0].finish_reason or finish
        return tokens, prompt_ids, finish

    async def run() -> list[tuple[list[int], list[int], str | None]]:
        async with AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused",
                               max_retries=0, timeout=180) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run())
    tokenize = httpx.post(f"{cluster.http_url}/v1/completions", timeout=60, json={
        "prompt": prompts[0], "max_tokens": 1, "return_token_ids": True}).json()
    for i, (tokens, prompt_ids, finish) in enumerate(results):
        assert finish == "length", i
        ids = prompt_ids or (tokenize["prompt_token_ids"] if i == 0 else None)
        assert len(tokens) == 16, i
        if ids:
            assert tokens == reference(ids, max_tokens=16, ignore_eos=True), i



def test_disconnect_frees_every_block(cluster: UpProcess) -> None:
    body = {"prompt": "Tell me a very long story about a lighthouse keeper." * 8,
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break  # leave mid-stream
    wait_for(lambda: all_blocks_free(cluster), 30, "every KV block free on both workers")
    aborted = metric_values(cluster.http_url, "tandem_request_success_total")
    assert any(dict(k)["finished_reason"] == "abort" and v >= 1 for k, v in aborted.items())


SLOW_READERS = 50


def test_fifty_slow_readers_are_cut_and_the_gateway_stays_small(cluster: UpProcess) -> None:
    """50 streaming clients that read one byte a second (a small receive window): every stream
    is cut after the read timeout (request aborted on the workers, blocks free), and the gateway
    process grows by less than GROWTH_BOUND meanwhile; then a normal request is served."""
    growth_bound = 64 * 1024 * 1024  # 50 streams x (uvicorn's 64 KiB + a few deltas) + slack
    (gateway,) = [p for p in cluster.descendants()
                  if "ServeReplica:tandem:gateway" in " ".join(p.cmdline())]
    baseline = gateway.memory_info().rss
    before = _failures(cluster)
    body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 1000,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 20}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: tandem\r\n"
               b"Content-Type: application/json\r\n"
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    readers = []
    for _ in range(SLOW_READERS):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        sock.connect(("127.0.0.1", int(cluster.http_url.rsplit(":", 1)[1])))
        sock.sendall(request)
        sock.setblocking(False)
        readers.append(sock)
    peak = baseline
    try:
        def all_cut() -> bool:
            nonlocal peak
            for sock in readers:  # one byte each, once a second (wait_for's poll period)
                with contextlib.suppress(BlockingIOError, ConnectionResetError):
                    sock.recv(1)
            peak = max(peak, gateway.memory_info().rss)
            return _failures(cluster)["slow_client"] - before["slow_client"] == SLOW_READERS

        wait_for(all_cut, 240, f"all {SLOW_READERS} slow streams to be cut", poll_s=1.0)
    finally:
        for sock in readers:
            sock.close()
    assert peak - baseline < growth_bound, (baseline, peak)
    wait_for(lambda: all_blocks_free(cluster), 30, "every KV block free on both workers")
    in_flight = metric_values(cluster.http_url, "tandem_requests_in_flight")
    assert sum(in_flight.values()) == 0, in_flight
    response = httpx.post(f"{cluster.http_url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": QUESTION, "max_tokens": 4})
    assert response.status_code == 200, response.text


def _failures(cluster: UpProcess) -> dict[str, float]:
    values = metric_values(cluster.http_url, "tandem_request_failures_total")
    return {dict(key)["reason"]: value for key, value in values.items()}


def test_stop_string_ends_stream(client: OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Count: one, two, three,",
                                     max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    full = base.choices[0].text
    cut = len(full) // 2
    stop = full[cut:cut + 4]
    assert stop.strip(), full
    text, finish = "", None
    for chunk in client.completions.create(model=MODEL, prompt="Count: one, two, three,",
                                           max_tokens=20, temperature=0, stream=True,
                                           stop=[stop], extra_body={"ignore_eos": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert text == full[:full.index(stop)]
    assert finish == "stop"


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
    ({"prompt": [1] * 9000, "max_tokens": 1}, 400, "context length"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}', 413, "larger than the limit"),
])
def test_bad_requests_get_4xx(cluster: UpProcess, body: object, status: int,
                              needle: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{cluster.http_url}/v1/completions", content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert needle.lower() in message.lower(), message
    ok = httpx.post(f"{cluster.http_url}/v1/completions", timeout=60,
                    json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    return subprocess.run([str(TANDEM), "status", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_the_ready_line_states_the_kv_capacity_the_workers_report(cluster: UpProcess) -> None:
    """Each engine's KV cache in tokens (blocks x block size) is a gauge; the ready line names
    the smallest and how many sequences of the served context it holds."""
    capacity = per_worker(metric_values(cluster.http_url, "tandem_kv_cache_capacity_tokens"))
    blocks = per_worker(metric_values(cluster.http_url, "tandem_kv_cache_blocks"))
    assert capacity and all(capacity[w] == 16 * blocks[w] for w in blocks)
    context = httpx.get(f"{cluster.http_url}/v1/models", timeout=30).json()["data"][0][
        "max_model_len"]
    tokens = int(min(capacity.values()))
    assert (f"; KV cache {tokens} tokens per engine: {tokens // context} sequence(s) of "
            f"max_model_len {context}") in cluster.ready_line
    sequences = per_worker(metric_values(cluster.http_url, "tandem_kv_cache_max_len_sequences"))
    assert sequences == {w: v // context for w, v in capacity.items()}


def test_status_shows_both_workers(cluster: UpProcess) -> None:
    """`tandem status` (before the hung-prefill test below, which marks a worker down for a
    while): one prefill and one decode row matching /metrics, exit 0; a dead URL exits 2."""
    wait_for(lambda: all_blocks_free(cluster), 30, "an idle cluster")
    done = _status("--url", cluster.http_url, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    status = json.loads(done.stdout)
    assert (status["model"], status["healthy"], status["exit_code"]) == (MODEL, True, 0)
    assert status["in_flight_limit"] == 64
    totals = per_worker(metric_values(cluster.http_url, "tandem_kv_cache_blocks"))
    roles = {dict(labels)["worker"]: dict(labels)["role"]
             for labels in metric_values(cluster.http_url, "tandem_worker_info")}
    assert sorted(roles.values()) == ["decode", "prefill"]
    assert [w["role"] for w in status["workers"]] == ["prefill", "decode"]
    assert {w["worker"]: w["role"] for w in status["workers"]} == roles
    assert {w["worker"]: w["kv_blocks_total"] for w in status["workers"]} == totals
    assert all(w["healthy"] is True and w["kv_blocks_used"] == 0 and w["refusals"] == 0
               for w in status["workers"])
    prefill, decode = status["workers"]
    assert prefill["leases"] == 0 and prefill["kv_transfers"] is None
    assert decode["leases"] is None
    for key, name in [("kv_transfers", "tandem_kv_transfers_total"),
                      ("recomputes", "tandem_decode_recomputes_total")]:
        assert {decode["worker"]: decode[key]} == per_worker(metric_values(cluster.http_url,
                                                                           name))

    table = _status("--url", cluster.http_url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == f"model {MODEL} at {cluster.http_url}: gateway healthy"
    assert [line.split()[1] for line in lines[4:]] == ["prefill", "decode"]

    dead = f"http://127.0.0.1:{free_port()}"
    down = _status("--url", dead)
    assert down.returncode == 2
    assert down.stderr == f"tandem: error: cannot reach {dead}: connection refused\n"
    assert down.stdout == ""


def test_prefill_worker_hung_during_the_nixl_kv_pull(cluster: UpProcess,
                                                     reference) -> None:  # type: ignore[no-untyped-def]
    """tests/e2e/test_faults.py hangs a prefill worker during TCP pulls; here during a NIXL
    one (paired already, P stops when D confirms the pull): D cannot vouch for the blocks it
    read and recomputes the prompt; the output is exact, every block is free after."""
    recomputes = sum(metric_values(cluster.http_url, "tandem_decode_recomputes_total").values())
    response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
        "prompt": "Describe a quiet harbour at dawn.", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "seed": HUNG_PREFILL_SEED, "return_token_ids": True})
    resume_stopped_worker(cluster)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["token_ids"] == reference(body["prompt_token_ids"],
                                                        max_tokens=16, ignore_eos=True)
    wait_for(lambda: sum(metric_values(cluster.http_url, "tandem_decode_recomputes_total")
                         .values()) > recomputes, 10, "the decode worker's recompute")
    wait_for(lambda: all_blocks_free(cluster), 90, "every KV block free on both workers")


def test_up_exits_cleanly_on_sigterm_to_its_process_group(cluster: UpProcess) -> None:
    """Runs last in this module: the ready line came, requests were served; now SIGTERM to the
    whole process group (`docker stop`, systemd; the other clusters' teardowns signal
    `tandem up` alone): Ray's processes end with it, and `tandem up` does not wait on Serve's
    controller, gone with them (it did, for 30 s)."""
    assert cluster.ready_s > 0
    assert cluster.stop(group=True) == 0
    assert cluster.leftovers() == []
    assert "Controller failed to shut down" not in cluster.log_path.read_text()
