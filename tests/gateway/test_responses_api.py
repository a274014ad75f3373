"""The Responses API (/v1/responses) with the official openai client: a conversation continued by
``previous_response_id`` gives the tokens the same chat completion gives; streamed events add up
to the response; function calls in and out; stored responses kept per tenant, retrieved and
deleted; what is not served is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tandem.services.gateway.errors import GatewayError
from tandem.services.gateway.responses_api import ResponseStore
from tandem.services.gateway.runner import ServeAddresses

GREEDY = {"temperature": 0.0, "max_output_tokens": 12}
INSTRUCTIONS = "You are a terse assistant."
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER}


def _chat(client: openai.OpenAI, messages: list[dict]) -> str:
    reply = client.chat.completions.create(model="", messages=messages, temperature=0.0,
                                           max_completion_tokens=12)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def test_a_conversation_continues_from_the_previous_response(client: openai.OpenAI) -> None:
    first = client.responses.create(model="", input="Name a colour.",
                                    instructions=INSTRUCTIONS, **GREEDY)  # type: ignore[arg-type]
    assert first.status == "incomplete" or first.status == "completed"
    assert first.output_text == _chat(client, [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour."}])
    assert first.usage is not None and first.usage.output_tokens <= 12
    second = client.responses.create(model="", input="And another?", previous_response_id=first.id,
                                     instructions=INSTRUCTIONS, **GREEDY)  # type: ignore[arg-type]
    assert second.previous_response_id == first.id
    assert second.output_text == _chat(client, [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"}])
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens
    # Stored: retrieved as returned, then deleted.
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="", input="Say hello.", **GREEDY)  # type: ignore[arg-type]
    events = list(client.responses.create(model="", input="Say hello.", stream=True,
                                          **GREEDY))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.status == whole.status
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    # The streamed response is stored too: the next turn continues from it.
    after = client.responses.create(model="", input="Again.", previous_response_id=final.id,
                                    **GREEDY)  # type: ignore[arg-type]
    assert after.output_text == _chat(client, [
        {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": text},
        {"role": "user", "content": "Again."}])


def test_function_calls_go_out_and_their_results_come_back(client: openai.OpenAI) -> None:
    forced = client.responses.create(model="", input="Weather in Oslo?", tools=[TOOL],  # type: ignore[list-item]
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     **GREEDY | {"max_output_tokens": 40})  # type: ignore[arg-type]
    call, = [item for item in forced.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) <= {"city"}
    streamed = list(client.responses.create(
        model="", input="Weather in Oslo?", tools=[TOOL], stream=True,  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        **GREEDY | {"max_output_tokens": 40}))  # type: ignore[arg-type]
    done, = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == (call.name, call.arguments)  # type: ignore[union-attr]
    # The call and its result as input items render as the chat turns that carry them.
    result = client.responses.create(model="", tools=[TOOL], tool_choice="none", input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        **GREEDY)  # type: ignore[arg-type]
    chat = client.chat.completions.create(
        model="", temperature=0.0, max_completion_tokens=12, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert result.output_text == chat.choices[0].message.content


def test_a_cut_reply_is_incomplete(client: openai.OpenAI) -> None:
    cut = client.responses.create(model="", input="Count to twenty.", temperature=0.0,
                                  max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server: ServeAddresses, fields: dict,
                                                      param: str) -> None:
    body = {"model": "", "input": "Hi", **fields}
    reply = httpx.post(f"{server.http_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_stored_responses_are_the_tenants_own_and_bounded() -> None:
    store = ResponseStore(max_responses=2)
    for i, previous in enumerate((None, "r0", "r1")):
        store.put("a", previous, [{"role": "user", "content": f"turn {i}"}], {"id": f"r{i}"})
    assert store.get("b", "r2") is None and store.get("a", "r2") == {"id": "r2"}
    with pytest.raises(GatewayError, match="not found"):
        store.history("b", "r2")  # another tenant's id is unknown
    with pytest.raises(GatewayError, match="'r0' is no longer stored"):
        store.history("a", "r2")  # r0 dropped (at most two kept): the chain is broken
    store.put("a", None, [{"role": "user", "content": "x"}], {"id": "r3"})
    assert [t["content"] for t in store.history("a", "r3")] == ["x"]
    assert not store.delete("b", "r3") and store.delete("a", "r3")


def test_one_tenants_responses_never_drop_anothers() -> None:
    store = ResponseStore(max_chars=2_000)
    store.put("calm", None, [{"role": "user", "content": "keep me"}], {"id": "c0"})
    for i in range(50):  # a flood of large responses, ~500 characters each
        store.put("flood", None, [{"role": "user", "content": "y" * 450}], {"id": f"f{i}"})
        assert store.get("calm", "c0") == {"id": "c0"}
    kept = [i for i in range(50) if store.get("flood", f"f{i}") is not None]
    # The flood's own oldest went: four of its ~494-character responses fit in 2,000.
    assert kept == list(range(46, 50))
    expiring = ResponseStore(ttl_s=0.0)
    expiring.put("a", None, [], {"id": "gone"})
    assert expiring.get("a", "gone") is None
