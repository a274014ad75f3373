"""Anthropic's Messages API (``POST /v1/messages``) over the chat path.

A request is turned into a chat completion request (``to_chat``): ``system`` becomes the system
message; each message's blocks their chat counterparts (``text``; an assistant's ``tool_use``
its tool calls; a user's ``tool_result`` a tool turn, before the message's text; ``thinking``
blocks dropped, as chat turns drop reasoning); ``tools`` (``input_schema``), ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``), ``stop_sequences``,
``thinking`` (the template's ``enable_thinking``) theirs. The reply is the chat reply written as
content blocks (``thinking``, ``text``, ``tool_use``) or, streamed, as Anthropic's events
(``MessageEvents``). Errors are Anthropic's error objects (``error_json``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from tandem.services.gateway.errors import GatewayError, bad_request, unsupported
from tandem.services.gateway.openai_protocol import Int, RequestBody, refused_extra
from tandem.services.gateway.pipeline import Delta, Usage
from tandem.services.gateway.tools import CallDelta, ToolCall

MAX_STOP_SEQUENCES = 16


class MessagesRequest(RequestBody):
    model: str
    max_tokens: Int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    # Sampling, as older clients send it (the current API leaves it to the model).
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, as chat's user
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "disabled", ...}
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted: one tier here
    # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}: structured output and
    # the template's reasoning_effort (xhigh and max as high)
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # accepted: every prefix is cached anyway

    def unsupported_fields(self) -> GatewayError | None:
        return refused_extra(self.model_extra)


def to_chat(body: MessagesRequest) -> dict[str, Any]:
    """The chat completion request (as JSON) that ``body`` asks for; 400 naming the Messages
    field for what has no chat counterpart."""
    messages = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        messages.extend(_chat_messages(message, i))
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "max_completion_tokens": body.max_tokens, "stream": body.stream}
    for name, value in (("temperature", body.temperature), ("top_p", body.top_p),
                        ("top_k", body.top_k), ("stop", body.stop_sequences)):
        if value is not None:
            chat[name] = value
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str):
        chat["user"] = user
    if body.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    if body.output_config is not None:
        chat.update(_output_config(body.output_config))
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking.type must be enabled, disabled or adaptive",
                              param="thinking.type")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    return chat


def _chat_messages(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"messages[{i}].role must be user or assistant, got {role!r}",
                          param=f"messages[{i}].role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be text or a list of content blocks",
                          param=f"messages[{i}].content")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": _string(block, "id", where), "type": "function",
                          "function": {"name": _string(block, "name", where),
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                            "content": _text(result, f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise unsupported(where, f"a {role} content block of type {kind!r}")
    turns: list[dict[str, Any]] = list(results)
    if role == "assistant" and calls:
        turns.append({"role": "assistant", "content": "".join(texts) or None,
                      "tool_calls": calls})
    elif texts or not results:
        turns.append({"role": role, "content": "".join(texts)})
    return turns


def _text(value: object, where: str) -> str:
    """Text, or a list of text blocks (``cache_control`` accepted: every prefix is cached)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                       and isinstance(b.get("text"), str) for b in value):
        return "".join(b["text"] for b in value)
    raise bad_request(f"{where} must be text or a list of text blocks", param=where)


def _string(block: dict[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{name} must be a non-empty string", param=f"{where}.{name}")
    return value


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type", "custom") != "custom":
        raise unsupported(f"tools[{i}].type", f"a tool of type {tool.get('type')!r} (client "
                                              "tools with an input_schema are served)")
    unknown = sorted(set(tool) - {"type", "name", "description", "input_schema",
                                  "cache_control"})
    if unknown:
        raise bad_request(f"Unknown field {unknown[0]!r}", param=f"tools[{i}].{unknown[0]}")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _output_config(config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise bad_request(f"Unknown field {unknown[0]!r}", param=f"output_config.{unknown[0]}")
    chosen: dict[str, Any] = {}
    given = config.get("format")
    if given is not None:
        if not isinstance(given, dict) or given.get("type") != "json_schema":
            raise bad_request("output_config.format.type must be json_schema",
                              param="output_config.format.type")
        chosen["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": given.get("schema")}}
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise bad_request("output_config.effort must be low, medium, high, xhigh or max",
                              param="output_config.effort")
        chosen["reasoning_effort"] = "high" if effort in ("xhigh", "max") else effort
    return chosen


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    chosen: dict[str, Any] = {}
    if kind == "tool":
        chosen["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind in ("auto", "any", "none"):
        chosen["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad_request("tool_choice.type must be auto, any, tool or none",
                          param="tool_choice.type")
    if choice.get("disable_parallel_tool_use"):
        chosen["parallel_tool_calls"] = False
    return chosen


# -- The reply ------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, stop_string: str | None, calls: list[ToolCall]
                ) -> str:
    if calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def usage_json(usage: Usage | None, prompt_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: input tokens not read from the cache, and those read from it."""
    cached = usage.cached_tokens if usage is not None else 0
    return {"input_tokens": (usage.prompt_tokens if usage else prompt_tokens) - cached,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": usage.completion_tokens if usage is not None else 0}


def tool_use_block(call: ToolCall, streamed: bool = False) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}",
            "name": call.name, "input": {} if streamed else json.loads(call.arguments)}


def content_blocks(content: str | None, calls: list[ToolCall], reasoning: str | None
                   ) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks.extend(tool_use_block(call) for call in calls)
    return blocks


def message_json(message_id: str, model: str, blocks: list[dict[str, Any]],
                 reason: str | None, stop_string: str | None, usage: dict[str, Any]
                 ) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": stop_string,
            "usage": usage}


class MessagesErrorDetail(BaseModel):
    type: str
    message: str  # names the offending field where there is one


class MessagesError(BaseModel):
    """Anthropic's error body (``error_json``); only described in the OpenAPI document."""

    type: Literal["error"]
    error: MessagesErrorDetail


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_json(error: GatewayError) -> dict[str, Any]:
    """Anthropic's error object (its message names the field where there is one)."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"),
                                       "message": message}}


class MessageEvents:
    """A streamed message's events: ``message_start``, a content block per kind as it forms
    (``thinking``, ``text``, ``tool_use`` with its input's ``input_json_delta`` pieces),
    ``message_delta`` (the stop reason and usage) and ``message_stop``."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self._id, self._model, self._prompt_tokens = message_id, model, prompt_tokens
        self._index = -1
        self._open: str | None = None  # the kind of the block being streamed

    def start(self) -> Iterator[dict[str, Any]]:
        yield {"type": "message_start", "message": message_json(
            self._id, self._model, [], None, None, usage_json(None, self._prompt_tokens))}

    def reasoning(self, text: str) -> Iterator[dict[str, Any]]:
        if text:
            yield from self._block("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": text})

    def content(self, text: str) -> Iterator[dict[str, Any]]:
        if text:
            yield from self._block("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": text})

    def calls(self, deltas: list[CallDelta]) -> Iterator[dict[str, Any]]:
        """Each call as it forms: a ``tool_use`` block, its input's JSON text in pieces."""
        for delta in deltas:
            yield from self._block(f"tool_use {delta.call.id}",
                                   tool_use_block(delta.call, streamed=True))
            if delta.arguments:
                yield self._delta({"type": "input_json_delta",
                                   "partial_json": delta.arguments})

    def finish(self, calls: list[ToolCall], last: Delta) -> Iterator[dict[str, Any]]:
        """``calls``: the reply's (as ``calls`` streamed them); ``last``: its last delta (its
        finish reason, stop string and usage)."""
        yield from self._close()
        yield {"type": "message_delta",
               "delta": {"stop_reason": stop_reason(last.finish_reason, last.stop_string, calls),
                         "stop_sequence": last.stop_string},
               "usage": usage_json(last.usage, self._prompt_tokens)}
        yield {"type": "message_stop"}

    def _block(self, kind: str, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if self._open == kind:
            return
        yield from self._close()
        self._index += 1
        self._open = kind
        yield {"type": "content_block_start", "index": self._index, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self) -> Iterator[dict[str, Any]]:
        if self._open is not None:
            self._open = None
            yield {"type": "content_block_stop", "index": self._index}
