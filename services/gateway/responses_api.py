"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A request is turned into a chat completion request (``to_chat``): ``instructions`` become the
system message, ``input`` (text, or items: messages, ``function_call`` and
``function_call_output``) the turns, after the turns of the ``previous_response_id`` chain;
function ``tools``, ``tool_choice``, ``text.format`` and ``reasoning.effort`` their chat
counterparts. The reply is the chat reply (content, tool calls, reasoning: the same parsers)
written as Responses' output items (``response_json``) or, streamed, as its events
(``ResponseEvents``).

Conversation state: a stored response keeps its own turns (its input and its output) and the
id of the response before it; a later request naming it walks the chain back. Kept per tenant
(another tenant's id is unknown; each tenant's own count and size bounds) for at most
``ttl_s`` each, in Redis where the cluster has one (``RedisResponseStore``: every gateway
replica sees it, a restart keeps it), else in the gateway's process (``ResponseStore``); a
chain whose oldest responses were dropped is refused with a 400 naming
``previous_response_id``, a store that does not answer with a 503.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import Field

from tandem.services.gateway.errors import GatewayError, bad_request, unsupported
from tandem.services.gateway.openai_protocol import Int, RequestBody, refused_extra
from tandem.services.gateway.pipeline import Delta, Usage
from tandem.services.gateway.tools import CallDelta, ToolCall

MAX_ID_CHARS = 128
T = TypeVar("T")


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    text: dict[str, Any] | None = None  # {"format": {"type": text | json_object | json_schema}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}; the template's reasoning_effort
    truncation: Literal["disabled"] | None = None  # "auto" (drop old turns) is not served
    # Accepted, as on chat completions.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    background: bool = False  # true (run detached, poll for it) is not served
    include: list[str] | None = None  # extra output data: none is served

    def unsupported_fields(self) -> GatewayError | None:
        if self.background:
            return unsupported("background", "background responses")
        if self.include:
            return unsupported("include", f"include={self.include!r}")
        return refused_extra(self.model_extra)


def to_chat(body: ResponsesRequest, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request (as JSON) that ``body`` asks for: its ``instructions``, then
    ``turns`` (the chain's and its input's, as chat messages). 400 naming the Responses field
    for what has no chat counterpart."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"messages": [*messages, *turns], "stream": body.stream}
    for name, value in (("model", body.model), ("max_completion_tokens", body.max_output_tokens),
                        ("temperature", body.temperature), ("top_p", body.top_p),
                        ("parallel_tool_calls", body.parallel_tool_calls),
                        ("prompt_cache_key", body.prompt_cache_key),
                        ("user", body.user), ("safety_identifier", body.safety_identifier)):
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function" or "name" not in body.tool_choice:
            raise bad_request("tool_choice must be none, auto, required or "
                              '{"type": "function", "name": ...}', param="tool_choice")
        chat["tool_choice"] = {"type": "function",
                               "function": {"name": body.tool_choice["name"]}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.text and body.text.get("format") is not None:
        chat["response_format"] = _response_format(body.text["format"])
    if body.reasoning and body.reasoning.get("effort") is not None:
        chat["reasoning_effort"] = body.reasoning["effort"]
    return chat


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls join one assistant turn."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input[{i}].role must be user, system, developer or "
                                  f"assistant, got {role!r}", param=f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i),
                                 "arguments": _field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": output if isinstance(output, str)
                             else _text(output, i, "output")})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: not shown again (as chat turns drop it)
        else:
            raise unsupported(f"input[{i}].type", f"an input item of type {kind!r}")
    return messages


def _text(content: object, i: int, name: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].{name} must be text or a list of text parts",
                          param=f"input[{i}].{name}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise unsupported(f"input[{i}].{name}[{j}]", f"a content part of type {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def _field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"input[{i}].{name} must be a non-empty string",
                          param=f"input[{i}].{name}")
    return value


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise unsupported(f"tools[{i}].type", f"a tool of type {tool.get('type')!r} (function "
                                              "tools are served)")
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise bad_request(f"Unknown field {unknown[0]!r}", param=f"tools[{i}].{unknown[0]}")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _response_format(given: object) -> dict[str, Any]:
    if not isinstance(given, dict) or given.get("type") not in ("text", "json_object",
                                                               "json_schema"):
        raise bad_request("text.format.type must be text, json_object or json_schema",
                          param="text.format.type")
    if given["type"] != "json_schema":
        return {"type": given["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in given.items()
                                                   if k in ("name", "schema", "strict")}}


# -- The response ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Reply:
    """One finished reply, as the chat path parsed it."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str | None
    finish_reason: str | None
    usage: Usage | None


def output_items(reply: Reply, ids: OutputIds) -> list[dict[str, Any]]:
    items = []
    if reply.reasoning:
        items.append(reasoning_item(ids.reasoning, reply.reasoning))
    if reply.content:
        items.append(message_item(ids.message, reply.content, "completed"))
    items.extend(call_item(call, "completed") for call in reply.calls)
    return items


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item_id(call: ToolCall) -> str:
    return f"fc_{call.id.removeprefix('call_')}"


def call_item(call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": call_item_id(call),
            "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


@dataclass
class OutputIds:
    reasoning: str = field(default_factory=lambda: new_id("rs"))
    message: str = field(default_factory=lambda: new_id("msg"))


def response_json(response_id: str, created_at: int, model: str, body: ResponsesRequest,
                  output: list[dict[str, Any]], reply: Reply | None) -> dict[str, Any]:
    """The response object; ``reply`` None: still in progress."""
    status, incomplete = "in_progress", None
    if reply is not None:
        status = "incomplete" if reply.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    usage = reply.usage if reply is not None else None
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "error": None, "incomplete_details": incomplete, "model": model, "output": output,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}}, "store": body.store,
        "metadata": body.metadata or {}, "truncation": "disabled",
        "usage": None if usage is None else {
            "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def turns_of(reply: Reply) -> list[dict[str, Any]]:
    """The reply as a chat turn (what a later request in the chain shows the model)."""
    if not reply.content and not reply.calls:
        return []
    turn: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        turn["tool_calls"] = [call.to_json() for call in reply.calls]
    return [turn]


class ResponseEvents:
    """A streamed response's server-sent events, each numbered (``sequence_number``)."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self._head = (response_id, int(time.time()), model, body)
        self.finished: Reply | None = None  # the whole reply, once ``finish`` made it
        self.response = response_json(*self._head, [], None)
        self._sequence = 0
        self.ids = OutputIds()
        self._reasoning: str | None = None  # the reasoning item's text while it is open
        self._text: str | None = None  # the message's text while it is open
        self._call: ToolCall | None = None  # the call being streamed
        self._done: list[dict[str, Any]] = []  # the output items finished
        self._all = {"reasoning": "", "content": ""}  # the whole reply's, for ``reply``

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def start(self) -> Iterator[dict[str, Any]]:
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)

    def reasoning(self, text: str) -> Iterator[dict[str, Any]]:
        if not text:
            return
        if self._reasoning is None:
            self._reasoning = ""
            yield self._added(reasoning_item(self.ids.reasoning, ""))
        self._reasoning += text
        self._all["reasoning"] += text
        yield self.event("response.reasoning_text.delta", item_id=self.ids.reasoning,
                         output_index=len(self._done), content_index=0, delta=text)

    def content(self, text: str) -> Iterator[dict[str, Any]]:
        if not text:
            return
        yield from self._close_reasoning()
        if self._text is None:
            self._text = ""
            yield self._added(message_item(self.ids.message, None, "in_progress"))
            yield self.event("response.content_part.added", item_id=self.ids.message,
                             output_index=len(self._done), content_index=0,
                             part=output_text(""))
        self._text += text
        self._all["content"] += text
        yield self.event("response.output_text.delta", item_id=self.ids.message,
                         output_index=len(self._done), content_index=0, delta=text,
                         logprobs=[])

    def calls(self, deltas: list[CallDelta]) -> Iterator[dict[str, Any]]:
        """Each call as it forms: a ``function_call`` item, its arguments' deltas."""
        for delta in deltas:
            if delta.started:
                yield from self._close_reasoning()
                yield from self._close_text()
                yield from self._close_call()
                yield self._added(call_item(delta.call, "in_progress", ""))
            self._call = delta.call
            if delta.arguments:
                yield self.event("response.function_call_arguments.delta",
                                 item_id=call_item_id(delta.call),
                                 output_index=len(self._done), delta=delta.arguments)

    def finish(self, calls: list[ToolCall], last: Delta) -> Iterator[dict[str, Any]]:
        """``calls``: the reply's (as ``calls`` streamed them); ``last``: its last delta (its
        finish reason and usage). Every event but the last (``terminal``), which the caller
        sends once the response is stored."""
        reply = Reply(self._all["content"] or None, calls, self._all["reasoning"] or None,
                      last.finish_reason, last.usage)
        yield from self._close_reasoning()
        yield from self._close_text()
        yield from self._close_call()
        self.response = response_json(*self._head, self._done, reply)
        self.finished = reply

    def terminal(self) -> dict[str, Any]:
        """``response.completed`` (or ``.incomplete``), with the whole response."""
        kind = ("response.incomplete" if self.response["status"] == "incomplete"
                else "response.completed")
        return self.event(kind, response=self.response)

    def _close_reasoning(self) -> Iterator[dict[str, Any]]:
        if self._reasoning is None:
            return
        text, self._reasoning = self._reasoning, None
        yield self.event("response.reasoning_text.done", item_id=self.ids.reasoning,
                         output_index=len(self._done), content_index=0, text=text)
        yield self._item_done(reasoning_item(self.ids.reasoning, text))

    def _close_text(self) -> Iterator[dict[str, Any]]:
        if self._text is None:
            return
        index, text, item_id = len(self._done), self._text, self.ids.message
        yield self.event("response.output_text.done", item_id=item_id, output_index=index,
                         content_index=0, text=text, logprobs=[])
        yield self.event("response.content_part.done", item_id=item_id, output_index=index,
                         content_index=0, part=output_text(text))
        yield self._item_done(message_item(item_id, text, "completed"))
        self._text = None
        self.ids.message = new_id("msg")  # text after a call is a message of its own

    def _close_call(self) -> Iterator[dict[str, Any]]:
        if self._call is None:
            return
        call, self._call = self._call, None
        yield self.event("response.function_call_arguments.done",
                         item_id=call_item_id(call), output_index=len(self._done),
                         name=call.name, arguments=call.arguments)
        yield self._item_done(call_item(call, "completed"))

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        return self.event("response.output_item.added", output_index=len(self._done),
                          item=item)

    def _item_done(self, item: dict[str, Any]) -> dict[str, Any]:
        self._done.append(item)
        return self.event("response.output_item.done", output_index=len(self._done) - 1,
                          item=item)


# -- Conversation state ---------------------------------------------------------------------


class StoreUnavailable(Exception):
    """The store (Redis) did not answer; the message says what failed."""


class _Chains:
    """What both stores share: a chain walked back from a response, oldest turns first."""

    async def record(self, tenant: str, response_id: str
                     ) -> tuple[str | None, list[dict[str, Any]], dict[str, Any]] | None:
        """(previous id, turns, response) of a stored response, or None."""
        raise NotImplementedError

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        found = await self.record(tenant, response_id)
        return None if found is None else found[2]

    async def history(self, tenant: str, response_id: str) -> list[dict[str, Any]]:
        """The chain's turns, oldest first, up to and including ``response_id``'s."""
        chain: list[list[dict[str, Any]]] = []
        at: str | None = response_id
        while at is not None:
            found = await self.record(tenant, at)
            if found is None:
                what = ("not found" if at == response_id
                        else f"its earlier response {at!r} is no longer stored")
                raise bad_request(f"previous_response_id {response_id!r}: {what}",
                                  param="previous_response_id")
            chain.append(found[1])
            at = found[0]
        return [turn for turns in reversed(chain) for turn in turns]


def _size(turns: list[dict[str, Any]], response: dict[str, Any]) -> int:
    """What a stored response counts against its tenant's bound: its turns and response as
    JSON, in characters."""
    return len(json.dumps(turns)) + len(json.dumps(response))


@dataclass
class _Stored:
    previous: str | None
    turns: list[dict[str, Any]]  # this response's input and output, as chat messages
    response: dict[str, Any]
    size: int
    expires: float


class ResponseStore(_Chains):
    """Stored responses by id (``store``, default true) in the gateway's process, kept per
    tenant: each tenant at most ``max_responses`` of them and ``max_chars`` characters for
    ``ttl_s`` each, its oldest dropped first; so one tenant's traffic never drops another's
    conversations. Lost when the gateway restarts (``RedisResponseStore`` keeps them)."""

    def __init__(self, max_responses: int = 10_000, max_chars: int = 256 << 20,
                 ttl_s: float = 3600.0) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self._tenants: dict[str, OrderedDict[str, _Stored]] = {}
        self._chars: dict[str, int] = {}

    async def put(self, tenant: str, previous: str | None, turns: list[dict[str, Any]],
                  response: dict[str, Any]) -> None:
        size = _size(turns, response)
        stored = self._tenants.setdefault(tenant, OrderedDict())
        stored[response["id"]] = _Stored(previous, turns, response, size,
                                         time.monotonic() + self.ttl_s)
        self._chars[tenant] = self._chars.get(tenant, 0) + size
        self._expire(tenant)
        while stored and (len(stored) > self.max_responses
                          or self._chars[tenant] > self.max_chars):
            self._drop(tenant, next(iter(stored)))

    async def record(self, tenant: str, response_id: str
                     ) -> tuple[str | None, list[dict[str, Any]], dict[str, Any]] | None:
        stored = self._find(tenant, response_id)
        return None if stored is None else (stored.previous, stored.turns, stored.response)

    async def delete(self, tenant: str, response_id: str) -> bool:
        if self._find(tenant, response_id) is None:
            return False
        self._drop(tenant, response_id)
        return True

    async def close(self) -> None:
        pass

    def _find(self, tenant: str, response_id: str) -> _Stored | None:
        self._expire(tenant)
        return self._tenants.get(tenant, {}).get(response_id)

    def _expire(self, tenant: str) -> None:
        stored, now = self._tenants.get(tenant), time.monotonic()
        while stored and next(iter(stored.values())).expires <= now:
            self._drop(tenant, next(iter(stored)))

    def _drop(self, tenant: str, response_id: str) -> None:
        self._chars[tenant] -= self._tenants[tenant].pop(response_id).size


# One tenant's stored responses in Redis, all under one hash tag (one cluster slot):
#   <tenant>:r:<id>  the response (JSON: previous, turns, response), expiring at its TTL
#   <tenant>:order   sorted set of its ids by arrival (a counter's value as the score)
#   <tenant>:sizes   hash id -> its size;  <tenant>:chars  the sizes' sum;  <tenant>:seq
# The bookkeeping expires with the tenant's newest response. Every change is one script, so
# concurrent gateways keep the counts right.
_DROP = """
local function drop(rid)
  local size = redis.call('HGET', KEYS[2], rid)
  if size then redis.call('DECRBY', KEYS[3], size) end
  redis.call('HDEL', KEYS[2], rid)
  redis.call('ZREM', KEYS[1], rid)
  redis.call('DEL', ARGV[1] .. rid)
end
"""
_PUT = _DROP + """
local id, body, size = ARGV[2], ARGV[3], tonumber(ARGV[4])
local expires, max_n, max_chars = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
while true do  -- the expired, oldest first (every response lives as long)
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not oldest or redis.call('EXISTS', ARGV[1] .. oldest) == 1 then break end
  drop(oldest)
end
if redis.call('ZSCORE', KEYS[1], id) then drop(id) end
redis.call('SET', ARGV[1] .. id, body, 'PXAT', expires)
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), id)
redis.call('HSET', KEYS[2], id, size)
redis.call('INCRBY', KEYS[3], size)
while redis.call('ZCARD', KEYS[1]) > max_n
    or tonumber(redis.call('GET', KEYS[3]) or '0') > max_chars do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
for _, key in ipairs(KEYS) do redis.call('PEXPIREAT', key, expires) end
return 1
"""
_DELETE = _DROP + """
if redis.call('EXISTS', ARGV[1] .. ARGV[2]) == 0 then return 0 end
drop(ARGV[2])
return 1
"""


class RedisResponseStore(_Chains):
    """``ResponseStore``'s bounds and TTL, kept in Redis: shared by every gateway replica and
    kept across a gateway's restart. A Redis that does not answer within ``timeout_s`` raises
    ``StoreUnavailable``."""

    PREFIX = "tandem:responses"

    def __init__(self, url: str, max_responses: int = 10_000, max_chars: int = 256 << 20,
                 ttl_s: float = 3600.0, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.max_responses = max_responses
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self.clock = clock  # wall clock, as Redis' expiry times are
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1), health_check_interval=0)
        self._put = self._client.register_script(_PUT)
        self._delete = self._client.register_script(_DELETE)

    def _keys(self, tenant: str) -> tuple[list[str], str]:
        tag = hashlib.sha256(tenant.encode()).hexdigest()[:16]
        base = f"{self.PREFIX}:{{{tag}}}"
        return [f"{base}:order", f"{base}:sizes", f"{base}:chars", f"{base}:seq"], f"{base}:r:"

    async def put(self, tenant: str, previous: str | None, turns: list[dict[str, Any]],
                  response: dict[str, Any]) -> None:
        keys, prefix = self._keys(tenant)
        body = json.dumps({"previous": previous, "turns": turns, "response": response})
        expires_ms = int((self.clock() + self.ttl_s) * 1000)
        await self._call(self._put(keys=keys, args=[
            prefix, response["id"], body, _size(turns, response), expires_ms,
            self.max_responses, self.max_chars]), "store a response")

    async def record(self, tenant: str, response_id: str
                     ) -> tuple[str | None, list[dict[str, Any]], dict[str, Any]] | None:
        _, prefix = self._keys(tenant)
        body = await self._call(self._client.get(prefix + response_id), "read a response")
        if body is None:
            return None
        stored = json.loads(body)
        return stored["previous"], stored["turns"], stored["response"]

    async def delete(self, tenant: str, response_id: str) -> bool:
        keys, prefix = self._keys(tenant)
        return bool(await self._call(self._delete(keys=keys, args=[prefix, response_id]),
                                     "delete a response"))

    async def close(self) -> None:
        await self._client.aclose()

    @staticmethod
    async def _call(command: Awaitable[T], what: str) -> T:
        import redis

        try:
            return await command
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"cannot {what} in Redis: {exc}") from None
