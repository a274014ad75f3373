"""A prompt's text is tokenized off the gateway's event loop, and a text too long for the context
whatever its tokens is refused before any tokenizing (issue 40: a few 1 MB prompts stalled every
stream while the loop tokenized them, then answered 400 anyway)."""

from __future__ import annotations

import threading

import grpc
import openai
import pytest

from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.conftest import MAX_MODEL_LEN


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
