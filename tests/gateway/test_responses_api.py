"""The Responses API (/v1/responses) with the official openai client: a conversation continued by
``previous_response_id`` gives the tokens the same chat completion gives; streamed events add up
to the response; function calls in and out; stored responses kept per tenant, retrieved and
deleted; what is not served is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.errors import GatewayError
from tandem.services.gateway.responses_api import RedisResponseStore, ResponseStore
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import serving
from tests.redis_server import RedisServer, running_redis

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
    pieces = [e.delta for e in streamed  # type: ignore[union-attr]
              if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments and len(pieces) > 3  # as they formed
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


def test_an_auto_call_streams_as_its_arguments_form(client: openai.OpenAI) -> None:
    """Under auto, after one turn that called the tool, the model calls it again: a
    ``function_call`` item whose arguments stream as deltas, the streamed response's."""
    shot = [{"role": "user", "content": "What's the weather like in Oslo today?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
            {"role": "assistant", "content": "It is sunny in Oslo, 21 C."},
            {"role": "user", "content": "What's the weather like in Paris today?"}]
    streamed = list(client.responses.create(model="", input=shot, tools=[TOOL], stream=True,  # type: ignore[arg-type, list-item]
                                            **GREEDY | {"max_output_tokens": 40}))  # type: ignore[arg-type]
    added = [e.item for e in streamed if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert [item.type for item in added] == ["function_call"]
    pieces = [e.delta for e in streamed  # type: ignore[union-attr]
              if e.type == "response.function_call_arguments.delta"]
    done = streamed[-1].response  # type: ignore[union-attr]
    call, = [item for item in done.output if item.type == "function_call"]
    assert call.name == "get_weather" and "".join(pieces) == call.arguments
    assert len(pieces) > 3 and set(json.loads(call.arguments)) <= {"city"}


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


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


Store = ResponseStore | RedisResponseStore


@pytest.fixture(params=["process", "redis"])
def make_store(request: pytest.FixtureRequest) -> Callable[..., Store]:
    """Either store, with the bounds given; each Redis one on a fresh database."""
    if request.param == "process":
        return ResponseStore
    server: RedisServer = request.getfixturevalue("redis_server")
    server.client().flushall()
    return lambda **bounds: RedisResponseStore(server.url, **bounds)


def _turn(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_stored_responses_are_the_tenants_own_and_bounded(make_store: Callable[..., Store]
                                                          ) -> None:
    async def scenario() -> None:
        store = make_store(max_responses=2)
        for i, previous in enumerate((None, "r0", "r1")):
            await store.put("a", previous, _turn(f"turn {i}"), {"id": f"r{i}"})
        assert await store.get("b", "r2") is None and await store.get("a", "r2") == {"id": "r2"}
        with pytest.raises(GatewayError, match="not found"):
            await store.history("b", "r2")  # another tenant's id is unknown
        with pytest.raises(GatewayError, match="'r0' is no longer stored"):
            await store.history("a", "r2")  # r0 dropped (at most two kept): the chain broke
        await store.put("a", None, _turn("x"), {"id": "r3"})
        assert [t["content"] for t in await store.history("a", "r3")] == ["x"]
        assert not await store.delete("b", "r3") and await store.delete("a", "r3")
        assert await store.get("a", "r3") is None and not await store.delete("a", "r3")
        await store.close()

    asyncio.run(scenario())


def test_one_tenants_responses_never_drop_anothers(make_store: Callable[..., Store]) -> None:
    async def scenario() -> None:
        store = make_store(max_chars=2_000)
        await store.put("calm", None, _turn("keep me"), {"id": "c0"})
        for i in range(50):  # a flood of large responses, ~500 characters each
            await store.put("flood", None, _turn("y" * 450), {"id": f"f{i}"})
            assert await store.get("calm", "c0") == {"id": "c0"}
        kept = [i for i in range(50) if await store.get("flood", f"f{i}") is not None]
        # The flood's own oldest went: four of its ~494-character responses fit in 2,000.
        assert kept == list(range(46, 50))
        expiring = make_store(ttl_s=0.0)
        await expiring.put("a", None, [], {"id": "gone"})
        assert await expiring.get("a", "gone") is None
        for each in (store, expiring):
            await each.close()

    asyncio.run(scenario())


def test_redis_keeps_the_counts_as_responses_expire(redis_server: RedisServer) -> None:
    """Expired responses leave the tenant's bookkeeping at its next store: what is left counts
    against the bounds, nothing else (responses stored with a clock past their TTL, not a
    wait)."""
    async def scenario() -> None:
        redis_server.client().flushall()
        now = [time.time() - 120.0]  # stored two minutes ago with a 60 s TTL: expired
        store = RedisResponseStore(redis_server.url, max_responses=3, ttl_s=60.0,
                                   clock=lambda: now[0])
        for i in range(3):
            await store.put("a", None, _turn(f"old {i}"), {"id": f"o{i}"})
        assert await store.get("a", "o2") is None
        now[0] = time.time()
        for i in range(3):
            await store.put("a", None, _turn(f"new {i}"), {"id": f"n{i}"})
        assert [await store.get("a", f"n{i}") for i in range(3)] == [
            {"id": f"n{i}"} for i in range(3)]  # three new ones fit: the old ones were dropped
        keys, _ = store._keys("a")
        client = redis_server.client()
        assert client.zcard(keys[0]) == 3 and client.hlen(keys[1]) == 3
        assert int(client.get(keys[2])) == sum(
            len(json.dumps(_turn(f"new {i}"))) + len(json.dumps({"id": f"n{i}"}))
            for i in range(3))
        await store.close()

    asyncio.run(scenario())


def test_with_redis_a_conversation_outlives_its_gateway(
        redis_server: RedisServer, async_engine: AsyncEngine, loaded_model: LoadedModel) -> None:
    """Stored in Redis, a conversation continues on another gateway (a restart, or another
    replica); a streamed response is stored before its last event reaches the client; with
    Redis stopped (SIGSTOP), a request naming a stored response is a 503 within the store's
    timeout, and one naming none is answered (its response counted as not stored)."""
    redis_server.client().flushall()

    def gateway() -> Gateway:
        return Gateway(EngineBackend(async_engine), loaded_model.tokenizer,
                       GatewayConfig(responses_redis_url=redis_server.url))

    def client_of(server: ServeAddresses) -> openai.OpenAI:
        return openai.OpenAI(api_key="unused", base_url=f"{server.http_url}/v1",
                             max_retries=0, timeout=120)

    with serving(gateway()) as first_server:
        first = client_of(first_server).responses.create(
            model="", input="Name a colour.", **GREEDY)  # type: ignore[arg-type]
    with serving(gateway()) as second_server:  # the first gateway is gone
        client = client_of(second_server)
        second = client.responses.create(model="", input="And another?",
                                         previous_response_id=first.id,
                                         **GREEDY)  # type: ignore[arg-type]
        assert second.output_text == _chat(client, [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}])
        assert client.responses.retrieve(first.id).output_text == first.output_text
        *_, last = client.responses.create(model="", input="Say hi.", stream=True,
                                           **GREEDY)  # type: ignore[arg-type]
        assert last.type in ("response.completed", "response.incomplete")
        streamed = last.response
        assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
        failures = "tandem_responses_store_failures_total"
        before = _metric(second_server, failures)
        redis_server.pause()
        try:
            with pytest.raises(openai.InternalServerError) as down:
                client.responses.create(model="", input="More?", previous_response_id=second.id,
                                        **GREEDY)  # type: ignore[arg-type]
            assert down.value.status_code == 503
            assert "stored responses cannot be read" in down.value.message
            answered = client.responses.create(model="", input="Hi",
                                               **GREEDY)  # type: ignore[arg-type]
            assert answered.output_text
        finally:
            redis_server.resume()
        assert _metric(second_server, failures) == before + 1
        # Redis back: the chain goes on.
        assert client.responses.create(model="", input="More?", previous_response_id=second.id,
                                       **GREEDY).output_text  # type: ignore[arg-type]


def _metric(server: ServeAddresses, name: str) -> float:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))
