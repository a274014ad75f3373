"""Anthropic's Messages API (/v1/messages) with the official anthropic client: a message gives the
tokens the same chat completion gives, whole and streamed; stop sequences, forced tool use and
tool results; the API key as x-api-key, per tenant; what is not served is a 400 in Anthropic's
error shape naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.gateway.tenants import Tenants
from tests.gateway.helpers import serving

SYSTEM = "You are a terse assistant."
# Greedy: the current API leaves sampling to the model (no temperature argument); Tandem still
# takes temperature, as older clients send it.
GREEDY = {"temperature": 0.0}
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}


@pytest.fixture(scope="module")
def claude(server: ServeAddresses, gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="unused", base_url=server.http_url, max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def model(gateway: Gateway) -> str:
    return gateway.model_name


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 12,
          **fields: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="", messages=messages, extra_body=GREEDY,  # type: ignore[arg-type]
                                          max_completion_tokens=max_tokens, **fields)  # type: ignore[call-overload]


def test_a_message_is_the_chat_completion_whole_and_streamed(
        claude: anthropic.Anthropic, client: openai.OpenAI, model: str) -> None:
    reply = claude.messages.create(model=model, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                   messages=ASK)  # type: ignore[arg-type]
    chat = _chat(client, [{"role": "system", "content": SYSTEM}, *ASK])
    text, = [b.text for b in reply.content if b.type == "text"]
    assert text == chat.choices[0].message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert chat.usage is not None
    assert (reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0),
            reply.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with claude.messages.stream(model=model, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                messages=ASK) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_a_stop_sequence_is_named(claude: anthropic.Anthropic, model: str) -> None:
    whole = claude.messages.create(model=model, max_tokens=24, extra_body=GREEDY,
                                   messages=ASK)  # type: ignore[arg-type]
    text = whole.content[0].text  # type: ignore[union-attr]
    stop = text.split()[2]
    cut = claude.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=ASK,  # type: ignore[arg-type]
                                 stop_sequences=["never appears", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]  # type: ignore[union-attr]


def test_tool_use_goes_out_and_its_result_comes_back(
        claude: anthropic.Anthropic, client: openai.OpenAI, model: str) -> None:
    forced = claude.messages.create(
        model=model, max_tokens=40, extra_body=GREEDY, tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}])
    use, = [b for b in forced.content if b.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and use.name == "get_weather"
    assert set(use.input) <= {"city"}  # type: ignore[arg-type]
    with claude.messages.stream(
            model=model, max_tokens=40, extra_body=GREEDY, tools=[TOOL],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        pieces = [event.delta.partial_json for event in stream  # type: ignore[union-attr]
                  if event.type == "content_block_delta"
                  and event.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    streamed, = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert json.loads("".join(pieces)) == use.input and len(pieces) > 3  # as it formed
    # The call and its result render as the chat turns that carry them.
    answer = claude.messages.create(
        model=model, max_tokens=12, extra_body=GREEDY, tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "none"}, messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                               "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "Sunny, 21 C"}]}])
    chat = _chat(client, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": use.id, "type": "function",
            "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"}],
        tool_choice="none", tools=[{"type": "function", "function": {
            "name": TOOL["name"], "description": TOOL["description"], "parameters": WEATHER}}])
    assert answer.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"container": "c_1"}, "container"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format.type"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server: ServeAddresses, model: str,
                                                      fields: dict, param: str) -> None:
    body = {"model": model, "max_tokens": 4, "messages": ASK, **fields}
    reply = httpx.post(f"{server.http_url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]


@pytest.fixture(scope="module")
def keyed_server(async_engine: AsyncEngine, loaded_model: LoadedModel
                 ) -> Iterator[ServeAddresses]:
    tenants = Tenants({"key-a": "acme"}, b"s" * 32)
    with serving(Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                         tenants=tenants)) as served:
        yield served


def test_the_api_key_comes_as_x_api_key(keyed_server: ServeAddresses, model: str) -> None:
    def ask(key: str) -> anthropic.types.Message:
        claude = anthropic.Anthropic(api_key=key, base_url=keyed_server.http_url,
                                     max_retries=0, timeout=120)
        return claude.messages.create(model=model, max_tokens=2, messages=ASK)  # type: ignore[arg-type]

    assert ask("key-a").type == "message"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        ask("key-wrong")
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
