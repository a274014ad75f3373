"""gRPC: streaming Generate, health checking, reflection, status codes, cancellation."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import engine_tokens, wait_engine_idle

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def channel(server: ServeAddresses) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


def greedy(max_tokens: int = MAX_TOKENS, **extra: object) -> pb.SamplingOptions:
    return pb.SamplingOptions(max_tokens=max_tokens, temperature=0.0, **extra)  # type: ignore[arg-type]


def test_chat_stream_matches_engine(stub: pb_grpc.GenerationStub, gateway: Gateway,
                                    async_engine: AsyncEngine) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = gateway.tokenizer.encode_chat(messages)
    expected = engine_tokens(async_engine, prompt, MAX_TOKENS)
    request = pb.GenerateRequest(
        model=gateway.model_name,
        chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
        sampling=greedy(logprobs=1))
    responses = list(stub.Generate(request, timeout=60))
    ids = [t for r in responses for t in r.token_ids]
    assert ids == expected
    assert "".join(r.text for r in responses) == gateway.tokenizer.decode(expected)
    assert sum(len(r.logprobs) for r in responses) == len(expected)
    assert all(len(lp.top) == 1 for r in responses for lp in r.logprobs)
    last = responses[-1]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(ids))
    assert len({r.request_id for r in responses}) == 1


def test_prompt_and_token_ids_give_the_same_tokens(stub: pb_grpc.GenerationStub,
                                                   gateway: Gateway,
                                                   async_engine: AsyncEngine) -> None:
    text = "The five largest cities in Europe are"
    prompt = gateway.tokenizer.encode(text)
    expected = engine_tokens(async_engine, prompt, MAX_TOKENS, ignore_eos=True)
    for request in (pb.GenerateRequest(prompt=text, sampling=greedy(ignore_eos=True)),
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                       sampling=greedy(ignore_eos=True))):
        responses = list(stub.Generate(request, timeout=60))
        assert [t for r in responses for t in r.token_ids] == expected
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_string(stub: pb_grpc.GenerationStub, gateway: Gateway,
                     async_engine: AsyncEngine) -> None:
    text = "The five largest cities in Europe are"
    reference = gateway.tokenizer.decode(
        engine_tokens(async_engine, gateway.tokenizer.encode(text), MAX_TOKENS, ignore_eos=True))
    stop = reference[len(reference) // 2:len(reference) // 2 + 3]
    responses = list(stub.Generate(pb.GenerateRequest(
        prompt=text, sampling=greedy(max_tokens=600, ignore_eos=True, stop=[stop])), timeout=60))
    assert "".join(r.text for r in responses) == reference[:reference.index(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    wait_engine_idle(async_engine, timeout_s=20)


def test_errors_map_to_status_codes(stub: pb_grpc.GenerationStub) -> None:
    cases = [
        (pb.GenerateRequest(model="gpt-17", prompt="x"), grpc.StatusCode.NOT_FOUND, "gpt-17"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(temperature=-1)),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(max_tokens=0)),
         grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        # The same bounds as HTTP, and finite numbers only.
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(temperature=float("nan"))),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(temperature=float("inf"))),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(temperature=3.0)),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(top_p=float("nan"))),
         grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt, chat or token_ids"),
        (pb.GenerateRequest(prompt="hello " * 2000), grpc.StatusCode.INVALID_ARGUMENT,
         "maximum context length"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6])),
         grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (pb.GenerateRequest(prompt="x" * (2 * 1024 * 1024)), grpc.StatusCode.RESOURCE_EXHAUSTED,
         ""),
    ]
    for request, code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
        assert info.value.code() == code, request
        assert words in info.value.details()
    # Still serving.
    responses = list(stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=greedy(2)),
                                   timeout=60))
    assert responses[-1].usage.completion_tokens >= 1


def test_cancelling_the_call_frees_every_block(stub: pb_grpc.GenerationStub,
                                               async_engine: AsyncEngine) -> None:
    call = stub.Generate(pb.GenerateRequest(
        prompt="Count to a thousand:", sampling=greedy(max_tokens=900, ignore_eos=True)),
        timeout=60)
    for received, _ in enumerate(call, start=1):
        if received == 3:
            break
    assert async_engine.stats.num_running == 1
    call.cancel()
    wait_engine_idle(async_engine, timeout_s=20)


def test_health_reports_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Generation"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(channel: grpc.Channel) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="tandem.v1.Generation")]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    assert files and b"tandem/v1/generation.proto" in files[0]


def test_a_tiny_temperature_is_greedy(stub: pb_grpc.GenerationStub) -> None:
    """temperature 1e-40 would overflow logits / T: below 1e-5 it is greedy, as in vLLM."""
    def tokens(temperature: float) -> list[int]:
        sampling = pb.SamplingOptions(max_tokens=8, temperature=temperature, ignore_eos=True)
        responses = stub.Generate(pb.GenerateRequest(prompt="The sky is", sampling=sampling),
                                  timeout=60)
        return [t for r in responses for t in r.token_ids]

    assert tokens(1e-40) == tokens(0.0)



def test_one_client_request_id_on_two_calls(stub: pb_grpc.GenerationStub, gateway: Gateway,
                                            async_engine: AsyncEngine) -> None:
    """A client's request_id is echoed, never a key: two concurrent calls with one id both get
    their own tokens, and cancelling one leaves the other intact."""
    texts = ["The five largest cities in Europe are", "A short poem about the sea:"]
    expected = [engine_tokens(async_engine, gateway.tokenizer.encode(t), 24, ignore_eos=True)
                for t in texts]
    calls = [stub.Generate(pb.GenerateRequest(request_id="same-id", prompt=t,
                                              sampling=greedy(24, ignore_eos=True)), timeout=60)
             for t in texts]
    first = [next(c) for c in calls]  # both running at once
    got = [[t for r in [head, *call] for t in r.token_ids] for head, call in zip(first, calls,
                                                                                strict=True)]
    assert got == expected
    assert {r.request_id for r in first} == {"same-id"}

    doomed = stub.Generate(pb.GenerateRequest(request_id="again", prompt=texts[0],
                                              sampling=greedy(200, ignore_eos=True)), timeout=60)
    kept = stub.Generate(pb.GenerateRequest(request_id="again", prompt=texts[1],
                                            sampling=greedy(24, ignore_eos=True)), timeout=60)
    heads = next(doomed), next(kept)
    doomed.cancel()
    assert [t for r in [heads[1], *kept] for t in r.token_ids] == expected[1]
    wait_engine_idle(async_engine, timeout_s=20)

    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(request_id="x" * 129, prompt="Hi"), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in info.value.details()


def test_a_client_pinging_every_5_s_while_idle_keeps_its_connection(
        server: ServeAddresses) -> None:
    """gRPC's default server policy answers a client that pings more often than every 5 minutes
    (or at all without a call) with GOAWAY too_many_pings, which drops its connection; ours
    accepts pings every 5 s, with or without calls (KEEPALIVE_OPTIONS)."""
    states: list[grpc.ChannelConnectivity] = []
    options = [("grpc.keepalive_time_ms", 5_000), ("grpc.keepalive_timeout_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0),
               ("grpc.http2.min_time_between_pings_ms", 5_000)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        channel.subscribe(states.append)
        idle = threading.Event()
        # Pings at 5, 10, 15 and 20 s without a call: under the default policy the third too
        # early one (20 s) gets GOAWAY, and the channel goes IDLE and reconnects.
        idle.wait(23.0)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        channel.unsubscribe(states.append)
    assert set(states) == {grpc.ChannelConnectivity.READY}, states  # never dropped


def test_tokenize_gives_the_ids_generate_and_http_see(stub: pb_grpc.GenerationStub,
                                                      server: ServeAddresses) -> None:
    messages = [pb.ChatMessage(role="user", content="What is 2+2?")]
    chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages)), timeout=30)
    prompt = stub.Tokenize(pb.TokenizeRequest(prompt="Hello there"), timeout=30)
    http = httpx.post(f"{server.http_url}/tokenize", timeout=30, json={
        "messages": [{"role": "user", "content": "What is 2+2?"}]}).json()
    assert list(chat.token_ids) == http["tokens"] and chat.max_model_len == http["max_model_len"]
    assert list(prompt.token_ids) == httpx.post(f"{server.http_url}/tokenize", timeout=30, json={
        "prompt": "Hello there"}).json()["tokens"]
    # Generate from the ids is Generate from the chat.
    by_chat = [t for r in stub.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=messages), sampling=greedy()), timeout=60)
        for t in r.token_ids]
    by_ids = [t for r in stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=chat.token_ids), sampling=greedy()), timeout=60)
        for t in r.token_ids]
    assert by_ids == by_chat
    for request, code in ((pb.TokenizeRequest(), grpc.StatusCode.INVALID_ARGUMENT),
                          (pb.TokenizeRequest(model="other", prompt="Hi"),
                           grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Tokenize(request, timeout=30)
        assert refused.value.code() == code
