"""Tool calling: the reply parsed (Hermes and Llama-3 styles), tool_choice required and named
enforced by the tool's schema over HTTP, tool-call deltas streamed under every choice,
tool-result turns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from tandem.services.engine.grammar import Grammars
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import ServeAddresses
from tandem.services.gateway.tool_parsers import PARSERS
from tandem.services.gateway.tools import (
    HERMES,
    CallStream,
    Function,
    ReplyStream,
    auto_constraint,
    parse_reply,
    with_tools,
)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
FUNCTIONS = [Function("get_weather", None, WEATHER), Function("get_time", None, TIME)]
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def test_replies_are_parsed_in_both_styles() -> None:
    hermes = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
              '"CET"}}\n</tool_call>\n<tool_call>{"name": "get_weather", "arguments": '
              '{"city": "Oslo", "unit": "celsius"}}</tool_call>')
    content, calls = parse_reply(hermes, FUNCTIONS, "auto")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"timezone": "CET"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert len({c.id for c in calls}) == 2
    llama3 = '{"name": "get_time", "parameters": {"timezone": "UTC"}}'
    content, calls = parse_reply(llama3, FUNCTIONS, "auto")
    assert content is None and calls[0].name == "get_time"
    for text in ("It is sunny.", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "get_time", "argu'):  # cut off before its arguments
        assert parse_reply(text, FUNCTIONS, "auto") == (text, [])
    cut = '<tool_call>{"name": "get_time", "arguments": {"timezone": "CE'  # within them
    assert [(c.name, c.arguments) for c in parse_reply(cut, FUNCTIONS, "auto")[1]] == [
        ("get_time", '{"timezone": "CE')]
    assert parse_reply(llama3, FUNCTIONS, "none") == (llama3, [])
    content, calls = parse_reply('{"timezone": "UTC"}', FUNCTIONS, "get_time")
    assert content is None and (calls[0].name, calls[0].arguments) == (
        "get_time", '{"timezone": "UTC"}')


def test_under_auto_the_grammar_holds_calls_to_the_tools(loaded_model: LoadedModel) -> None:
    """auto_constraint: text stays free (a tag's near miss too), and each call, opened by the
    tag, names one of the tools with arguments valid against its parameters; parallel false
    allows one call; families other than Hermes get none."""
    grammars = Grammars(loaded_model.tokenizer)
    call = ('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n'
            "</tool_call>")

    def accepts(text: str, parallel: bool = True) -> bool:
        constraint = auto_constraint(FUNCTIONS, HERMES, parallel)
        assert constraint is not None and grammars.problem(constraint) is None
        matcher = grammars.matcher(constraint, [])
        return (all(matcher.consume_token(t) for t in loaded_model.tokenizer.encode(text))
                and matcher.is_accepting())

    assert accepts("") and accepts("It is sunny.\nA tag: <tool_cal> is no call.")
    assert accepts(f"Let me check. {call}") and accepts(f"{call}\n{call}\nDone.")
    assert accepts('<tool_call>{"name":"get_weather","arguments":{"city":"Oslo",'
                   '"unit":"celsius"}}</tool_call>')
    assert not accepts(f"{call}\n{call}", parallel=False) and accepts(call, parallel=False)
    for wrong in ('{"name": "get_date", "arguments": {}}',  # not a tool
                  '{"name": "get_time", "arguments": {"tz": "CET"}}',  # not its parameters
                  '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}'):
        assert not accepts(f"<tool_call>\n{wrong}\n</tool_call>"), wrong
    assert not accepts("<tool_call>\nplain text")
    assert all(auto_constraint(FUNCTIONS, parser) is None
               for parser in PARSERS.values() if parser is not HERMES)


def test_the_tools_go_into_the_system_prompt() -> None:
    plain = with_tools(ASK, FUNCTIONS, template_renders_tools=False)
    assert plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert json.dumps(FUNCTIONS[0].spec()) in plain[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *ASK]
    merged = with_tools(system, FUNCTIONS, template_renders_tools=False)
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\n")
    assert with_tools(ASK, FUNCTIONS, template_renders_tools=True) == ASK
    assert with_tools(ASK, [], template_renders_tools=False) == ASK


def test_a_call_streams_its_arguments_as_they_form() -> None:
    """CallStream, fed a reply a few characters at a time, gives the call's name once and its
    arguments' text piece by piece; reassembled, the same call as the whole reply's."""
    arguments = '{"city": "Oslo {}", "unit": {"deep": [1, {"x": 2}]}}'
    replies = [("required", '{"name": "get_weather", "arguments": ' + arguments + "}"),
               ("required", '{ "name":"get_weather" ,"arguments":' + arguments + " }"),
               ("get_weather", arguments)]
    for mode, reply in replies:
        stream = CallStream(None if mode == "required" else mode)
        starts, pieces = 0, []
        for i in range(0, len(reply), 3):
            started, new = stream.feed(reply[i:i + 3])
            starts += started
            pieces.append(new)
        pieces.append(stream.finish())
        assert starts == 1 and stream.call is not None
        assert stream.call.name == "get_weather"
        assert "".join(pieces) == stream.call.arguments == arguments, (mode, reply)
        assert len([p for p in pieces if p]) > 5  # not all at the end
        assert parse_reply(reply, FUNCTIONS, mode)[1][0].arguments == arguments
    cut = CallStream(None)  # cut short at max_tokens: the arguments as far as they came
    cut.feed('{"name": "get_time", "arguments": {"timezone": "CE')
    assert cut.finish() == ""
    assert cut.call is not None and cut.call.arguments == '{"timezone": "CE'
    early = CallStream(None)  # cut before the call began: no call, the text is content
    assert early.feed('{"name": "get_ti') == (False, "") and early.call is None
    assert parse_reply('{"name": "get_ti', FUNCTIONS, "required") == ('{"name": "get_ti', [])


def test_under_auto_content_streams_until_a_call_may_begin() -> None:
    """ReplyStream, fed 3 characters at a time: text goes out as it comes (all but a tail that
    may open a call); from a call on it is held, and the call goes out as it forms (its id
    and name once, then its arguments); reassembled, what parse_reply gives whole."""
    hermes = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
              '"CET"}}\n</tool_call>')
    replies = [hermes, "It is sunny in Paris, about 21 C.", "A tag: <tool_ca is no call.",
               '{"name": "get_time", "parameters": {"timezone": "UTC"}}',
               '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
               '  {"not": "a call"}']
    for reply in replies:
        stream = ReplyStream(FUNCTIONS)
        fed = [stream.feed(reply[i:i + 3]) for i in range(0, len(reply), 3)]
        rest, last = stream.finish()
        content, expected = parse_reply(reply, FUNCTIONS, "auto")
        deltas = [d for _, ds in fed for d in ds] + last
        names = [d.call.name for d in deltas if d.started]
        arguments = "".join(d.arguments for d in deltas)
        assert [(c.name, c.arguments) for c in expected] == (
            [(names[0], arguments)] if names else []), reply
        streamed = "".join(sent for sent, _ in fed) + rest
        assert (streamed.strip() if expected else streamed) == (content or ""), reply
        if not reply.lstrip().startswith(("{", "<")):
            assert len([sent for sent, _ in fed if sent]) > 3, reply  # not all at the end
        if expected:
            assert len([d for _, ds in fed for d in ds if d.arguments]) > 3, reply
    stream = ReplyStream(FUNCTIONS)
    assert stream.feed("Let me check. <tool_") == ("Let me check.", [])  # the tag's start held
    assert stream.feed("call>{") == ("", [])


def streamed_calls(stream: openai.Stream, pieces: list[str] | None = None  # type: ignore[type-arg]
                   ) -> tuple[list[dict], str | None]:
    """Tool calls reassembled from streamed deltas, as OpenAI's clients do, and the finish;
    ``pieces`` collects the arguments' deltas."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or ():
            if pieces is not None and delta.function is not None and delta.function.arguments:
                pieces.append(delta.function.arguments)
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["id"] = delta.id or call.get("id")
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def one_call_whole_and_streamed(client: openai.OpenAI, request: dict[str, Any]
                                ) -> ChatCompletionMessageFunctionToolCall:
    """The reply's one call; streamed, the same call, its id and name first and then its
    arguments piece by piece as they formed (not whole at the end)."""
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls  # type: ignore[misc]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    pieces: list[str] = []
    calls, finish = streamed_calls(client.chat.completions.create(**request, stream=True),
                                   pieces)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)]
    assert len(pieces) > 3
    return call


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_validate_and_stream_the_same(
        client: openai.OpenAI, gateway: Gateway, tool_choice: object) -> None:
    request = {"model": gateway.model_name, "messages": ASK, "tools": TOOLS,
               "tool_choice": tool_choice, "max_tokens": 60, "temperature": 0}
    call = one_call_whole_and_streamed(client, request)
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    # The call and its result, sent back, render as a conversation the model continues.
    follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"result": "sunny, 21 C"}'}]
    reply = client.chat.completions.create(model=gateway.model_name, messages=follow_up,  # type: ignore[arg-type]
                                           tools=TOOLS, tool_choice="none", max_tokens=8,  # type: ignore[arg-type]
                                           temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_an_auto_reply_streams_its_content_and_ends_as_the_whole_reply(
        client: openai.OpenAI, gateway: Gateway) -> None:
    request = {"model": gateway.model_name, "messages": [
        {"role": "user", "content": "Say hello to Paris in one sentence, no tools needed."}],
        "tools": TOOLS, "tool_choice": "auto", "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**request).choices[0]  # type: ignore[call-overload]
    pieces = [chunk.choices[0].delta.content
              for chunk in client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
              if chunk.choices and chunk.choices[0].delta.content]
    assert whole.message.content and not whole.message.tool_calls  # this reply is text
    assert "".join(pieces) == whole.message.content
    assert len(pieces) > 3  # streamed as it formed, not one delta at its end


# One turn that called get_weather before: with it the model (greedy) calls it again, so the
# auto tests below see a call the model wrote itself under auto.
SHOT = [{"role": "user", "content": "What's the weather like in Oslo today?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Oslo, 21 C."}]


def test_an_auto_call_streams_as_it_forms(client: openai.OpenAI, gateway: Gateway) -> None:
    """Under auto, the call the model writes goes out as OpenAI's do: its id and name, then
    its arguments piece by piece; reassembled, the non-streamed reply's call."""
    request = {"model": gateway.model_name, "messages": [*SHOT, *ASK], "tools": TOOLS,
               "tool_choice": "auto", "max_tokens": 60, "temperature": 0}
    call = one_call_whole_and_streamed(client, request)
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_under_auto_a_call_is_held_to_its_tools_schema(client: openai.OpenAI,
                                                       gateway: Gateway) -> None:
    """A tool whose parameters need a field the model leaves out when free (``days``): under
    auto the call it writes has it, valid against the schema."""
    days = {**WEATHER, "required": [*WEATHER["required"], "days"],
            "properties": {**WEATHER["properties"],
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": days}}]
    request = {"model": gateway.model_name, "messages": [*SHOT, *ASK], "tools": tools,
               "max_tokens": 60, "temperature": 0}
    free = client.chat.completions.create(**request, tool_choice="none")  # type: ignore[call-overload]
    assert "<tool_call>" in free.choices[0].message.content  # the call, as text
    assert '"days"' not in free.choices[0].message.content
    call = one_call_whole_and_streamed(client, {**request, "tool_choice": "auto"})
    jsonschema.validate(json.loads(call.function.arguments), days)


@pytest.fixture(scope="module")
def http(server: ServeAddresses) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


def test_a_tool_turn_renders_in_the_prompt(http: httpx.Client) -> None:
    messages = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                            "function": {"name": "get_time",
                                                                         "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "tool\n12:00" in text


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_are_400(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2,
                                                       **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)
