"""Bounds on what one request may cost the gateway (issue 40): a prompt's text is tokenized off
the event loop, a text too long for the context whatever its tokens is refused before any
tokenizing (a few 1 MB prompts stalled every stream while the loop tokenized them, then answered
400 anyway), and a non-streaming response too large to hold in memory is refused up front."""

from __future__ import annotations

import threading

import grpc
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.conftest import MAX_MODEL_LEN
from tests.gateway.helpers import serving


def too_long(gateway: Gateway) -> str:
    """One character more than MAX_MODEL_LEN tokens of this vocabulary's longest can cover."""
    return "x" * (MAX_MODEL_LEN * gateway.tokenizer.max_token_chars + 1)


def test_a_text_longer_than_any_context_is_refused_by_its_size(client: openai.OpenAI,
                                                               gateway: Gateway) -> None:
    limit = MAX_MODEL_LEN * gateway.tokenizer.max_token_chars
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt=too_long(gateway), max_tokens=1)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")
    assert (f"prompt has {limit + 1} characters: more than the {MAX_MODEL_LEN} tokens of this "
            f"model's context could hold") in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", max_tokens=1, messages=[
            {"role": "system", "content": "x" * (limit // 2)},
            {"role": "user", "content": [{"type": "text", "text": "x" * (limit // 2 + 1)}]}])
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    # Just under the bound is tokenized and refused by its token count, as before.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="hello " * (MAX_MODEL_LEN + 10),
                                  max_tokens=1)
    assert "maximum context length is 1024 tokens" in info.value.message
    assert client.completions.create(model="", prompt="Hi", max_tokens=1).choices


def test_grpc_refuses_it_the_same_way(server: ServeAddresses, gateway: Gateway) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=too_long(gateway))])
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(chat=chat), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat has" in (info.value.details() or "")


def test_prompts_are_tokenized_on_the_gateways_tokenizer_threads(
        client: openai.OpenAI) -> None:
    client.chat.completions.create(model="", max_tokens=1,
                                   messages=[{"role": "user", "content": "Hello there"}])
    assert any(t.name.startswith("tandem-tokenize") for t in threading.enumerate())


def test_a_non_streaming_response_too_large_to_buffer_is_refused_naming_the_fields(
        async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    gateway = Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                      GatewayConfig(max_buffered_tokens=100))
    with serving(gateway) as addresses:
        client = openai.OpenAI(api_key="unused", base_url=f"{addresses.http_url}/v1",
                               max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="", prompt="Hi", n=2, max_tokens=30, logprobs=1)
        assert info.value.param == "max_tokens"
        assert ("n 2 x max_tokens 30 x (1 + logprobs 1) = 120 tokens is more than the 100 a "
                "non-streaming response may hold") in info.value.message
        # best_of counts: every candidate is held until the best are picked.
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="", prompt="Hi", best_of=4, max_tokens=30)
        # Streamed, nothing is held: served.
        stream = client.completions.create(model="", prompt="Hi", n=2, max_tokens=30,
                                           logprobs=1, stream=True, temperature=0)
        assert sum(len(chunk.choices) for chunk in stream) > 0
        assert client.completions.create(model="", prompt="Hi", max_tokens=30).choices
