"""gRPC chat with tools: a call forced by tool_choice comes on the last message and is the call
the HTTP API gives; earlier calls and their results render as over HTTP (the same tokens); under
auto the text is the content; bad tools are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import openai
import pytest

from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOL = pb.Tool(name="get_weather", description="The weather in a city",
               parameters_json=json.dumps(WEATHER))
HTTP_TOOL = {"type": "function", "function": {"name": "get_weather", "description":
                                              "The weather in a city", "parameters": WEATHER}}
ASK = "Weather in Oslo?"


@pytest.fixture(scope="module")
def stub(server: ServeAddresses) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def _generate(stub: pb_grpc.GenerationStub, chat: pb.ChatMessages, max_tokens: int = 40
              ) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(
        chat=chat, sampling=pb.SamplingOptions(max_tokens=max_tokens, temperature=0.0)),
        timeout=120))


def test_a_forced_call_is_the_http_apis_call(stub: pb_grpc.GenerationStub,
                                             client: openai.OpenAI) -> None:
    responses = _generate(stub, pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content=ASK)], tools=[TOOL],
        tool_choice="get_weather"))
    assert "".join(r.text for r in responses) == ""  # held to the call: no text
    assert all(not r.tool_calls for r in responses[:-1])
    call, = responses[-1].tool_calls
    http = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": ASK}], temperature=0.0,
        max_completion_tokens=40, tools=[HTTP_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    expected, = http.choices[0].message.tool_calls or []
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)  # type: ignore[union-attr]
    assert call.id.startswith("call_") and set(json.loads(call.arguments)) <= {"city"}


def test_calls_and_results_render_as_over_http(stub: pb_grpc.GenerationStub,
                                               client: openai.OpenAI, gateway: Gateway) -> None:
    arguments = json.dumps({"city": "Oslo"})
    responses = _generate(stub, pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content=ASK),
        pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="call_1", name="get_weather", arguments=arguments)]),
        pb.ChatMessage(role="tool", content="Sunny, 21 C", tool_call_id="call_1")],
        tools=[TOOL]), max_tokens=12)
    http = client.chat.completions.create(
        model="", temperature=0.0, max_completion_tokens=12, tools=[HTTP_TOOL],  # type: ignore[list-item]
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": arguments}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])
    assert responses[-1].usage.prompt_tokens == http.usage.prompt_tokens  # type: ignore[union-attr]
    # Under auto the text is the reply's content, and its calls (if any) the HTTP API's.
    assert "".join(r.text for r in responses) == (http.choices[0].message.content or "")
    assert [(c.name, c.arguments) for c in responses[-1].tool_calls] == [
        (c.function.name, c.function.arguments)  # type: ignore[union-attr]
        for c in http.choices[0].message.tool_calls or []]


@pytest.mark.parametrize(("chat", "param"), [
    (pb.ChatMessages(tools=[TOOL], tool_choice="get_time"), "chat.tool_choice"),
    (pb.ChatMessages(tool_choice="required"), "chat.tool_choice"),
    (pb.ChatMessages(tools=[pb.Tool(name="get weather")]), "chat.tools[0].name"),
    (pb.ChatMessages(tools=[pb.Tool(name="f", parameters_json="{not json")]),
     "chat.tools[0].parameters_json"),
])
def test_bad_tools_are_invalid_argument(stub: pb_grpc.GenerationStub, chat: pb.ChatMessages,
                                        param: str) -> None:
    chat.messages.append(pb.ChatMessage(role="user", content=ASK))
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, chat)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert param in refused.value.details()  # type: ignore[attr-defined]
