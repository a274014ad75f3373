"""Tool calling: tools into the prompt, ``tool_choice`` into a constraint, the reply into calls.

The convention is Hermes' (Qwen2.5, Hermes 2/3, many fine-tunes): the tools are described in
the system prompt inside ``<tools></tools>``, and the model answers a call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A chat template that renders
tools itself (it mentions ``tools``) is given them instead of the system prompt text.

- ``tool_choice`` ``none``: the reply is text. ``auto`` (the default with tools): the reply is
  parsed by the model family's parser (``tool_parsers``: Hermes' ``<tool_call>`` blocks by
  default; Mistral, Llama 3 JSON, pythonic, Qwen3-Coder XML by the chat template or the
  ``tool_call_parser`` setting); its calls become tool calls, the rest content.
  ``parallel_tool_calls`` false keeps the first call only.
- ``required``: the reply is held (structured output) to one call of one of the tools, whose
  arguments validate against that tool's parameters. A named function: the reply is held to
  that function's arguments. Either is read as it streams (``CallStream``).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.services.gateway.tool_parsers import PARSERS, ToolParser
from tandem.services.protocol.request import StructuredOutput

HERMES = PARSERS["hermes"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_CALL_CLOSE = re.compile(r"\s*\}")


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def schema(self) -> dict[str, Any]:
        return self.parameters or _ANY_OBJECT

    def spec(self) -> dict[str, Any]:
        """As the prompt shows it (OpenAI's tool object)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.schema()
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: object) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                  ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, text)


def system_prompt(functions: list[Function]) -> str:
    tools = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in functions)
    return ("You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist "
            "with the user query. Don't make assumptions about what values to plug into "
            f"functions.\n<tools>\n{tools}\n</tools>\nFor each function call, return a json "
            "object with function name and arguments within <tool_call></tool_call> XML tags:"
            '\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def assistant_calls_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's earlier tool calls, as the model would have written them."""
    blocks = []
    for call in calls:
        function = call.get("function", {})
        arguments = function.get("arguments", "{}")
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: shown as it came
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        blocks.append("<tool_call>\n" + json.dumps({"name": function.get("name"),
                                                    "arguments": arguments},
                                                   ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(blocks)


def with_tools(messages: list[dict[str, Any]], functions: list[Function],
               template_renders_tools: bool) -> list[dict[str, Any]]:
    """The messages with the tools' system prompt (first, or added to the system message)."""
    if not functions or template_renders_tools:
        return messages
    prompt = system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"},
                *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def constraint(functions: list[Function], choice: str | None) -> StructuredOutput | None:
    """``choice``: none, auto, required, or a function's name (auto: see ``auto_constraint``)."""
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        return StructuredOutput("json", json.dumps(_call_schema(functions)))
    function = next(f for f in functions if f.name == choice)
    return StructuredOutput("json", json.dumps(function.schema()))


def auto_constraint(functions: list[Function], parser: ToolParser, parallel: bool = True
                    ) -> StructuredOutput | None:
    """Under ``tool_choice`` auto, a grammar (llguidance's Lark) that leaves the reply free
    until it opens a call, then holds the call to one of the functions with arguments valid
    against its parameters, as ``required`` does; with ``parallel`` false, one call at most.
    Hermes' ``<tool_call>`` blocks only (None for the other families: their calls are parsed
    unconstrained)."""
    if parser is not HERMES:
        return None
    arguments = json.dumps(_call_schema(functions))
    return StructuredOutput("grammar", "\n".join((
        "%llguidance {}",
        "start: prose? | calls",
        f"calls: opened /[ \\n]*/ %json {arguments} /[ \\n]*/ \"</tool_call>\" "
        + ("(prose | calls)?" if parallel else "prose?"),
        "prose: PROSE",
        "PROSE: /(.|\\n)+/ & ~/(.|\\n)*<tool_call>(.|\\n)*/",  # text without the tag
        "opened[lazy]: /(.|\\n)*<tool_call>/",  # text up to the tag, which ends it
    )))


def _call_schema(functions: list[Function]) -> dict[str, Any]:
    """A call of one of ``functions``: ``{"name": ..., "arguments": {...}}``."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f.name}, "arguments": f.schema()}}
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def parse_reply(text: str, functions: list[Function], choice: str | None,
                parser: ToolParser = HERMES, parallel: bool = True
                ) -> tuple[str | None, list[ToolCall]]:
    """The reply's content and its tool calls (none: the text is all content), as streaming
    it gives them (``ReplyStream`` under auto, ``CallStream`` otherwise). ``parser``: the
    family's; ``parallel`` false (``parallel_tool_calls``): the first call only."""
    if choice in (None, "none"):
        return text, []
    if choice != "auto":  # required or a named function: one call
        stream = CallStream(None if choice == "required" else choice)
        stream.feed(text)
        stream.finish()
        return (None, [stream.call]) if stream.call is not None else (text, [])
    reply = ReplyStream(functions, parser, parallel)
    content = reply.feed(text)[0] + reply.finish()[0]
    return (content.strip() or None) if reply.calls else text, reply.calls


def _parsed(text: str, functions: list[Function], parser: ToolParser, parallel: bool
            ) -> tuple[str, list[ToolCall]] | None:
    """The whole reply read by the family's ``parser``: its content and calls; None: no
    well-formed call of one of the functions."""
    found = parser.parse(text, {f.name: f.schema() for f in functions})
    if found is None:
        return None
    content, calls = found
    return content, [new_call(name, arguments)
                     for name, arguments in calls[:None if parallel else 1]]


@dataclass(frozen=True)
class CallDelta:
    """What a reply's new text adds to one of its tool calls, as OpenAI streams
    ``tool_calls``: the call's id and name with its first delta (``started``), then its
    arguments' new text."""

    index: int  # the call's place among the reply's calls
    call: ToolCall  # the call so far
    started: bool
    arguments: str


def merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """``deltas`` with each call's run of deltas made one."""
    out: list[CallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index:
            before = out.pop()
            delta = CallDelta(delta.index, delta.call, before.started or delta.started,
                              before.arguments + delta.arguments)
        out.append(delta)
    return out


class ReplyStream:
    """A reply under ``tool_choice`` auto, read as it streams. Its text goes out as content
    until a call may be starting (one of the parser's markers, or a reply that opens as its
    calls may: ``{`` or ``[``); from there it is held. In the families whose calls' arguments
    are JSON text (the parser's ``next_call``), each call of one of the functions goes out as
    it forms: its id and name, then its arguments' text until their object closes (a reply
    cut short ends with them as far as they came, as OpenAI's do). At the end the whole reply
    is read by the parser: where no call streamed, its calls go out whole (the other
    families' always do) with the content not yet sent; where it holds no well-formed call,
    the held text goes out as content (after streamed calls: the text after them, such as a
    call of a function the request did not offer)."""

    def __init__(self, functions: list[Function], parser: ToolParser = HERMES,
                 parallel: bool = True) -> None:
        self._functions = functions
        self._parser = parser
        self._parallel = parallel
        self._text = ""
        self._sent = ""  # content already sent: a prefix of the text
        self._scan: int | None = None  # held from here: where the next call may begin
        self._open: ObjectEnd | None = None  # the last call's arguments, while open
        self.calls: list[ToolCall] = []  # the calls so far

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content to send now, and what the text adds to the calls."""
        since = max(len(self._text) - max(map(len, self._parser.markers)), 0)
        self._text += text
        content = self._content(since) if self._scan is None else ""
        return content, self._stream() if self._scan is not None else []

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The content still to send and the calls' last deltas."""
        parsed = _parsed(self._text, self._functions, self._parser, self._parallel)
        if not self.calls:
            if parsed is None:
                return self._text[len(self._sent):], []
            self.calls = parsed[1]
            return self._rest(parsed[0]), [CallDelta(i, call, True, call.arguments)
                                           for i, call in enumerate(self.calls)]
        if self._open is not None:  # cut short: the arguments as far as they came
            return "", self._grow(self._text[self._open.start:].rstrip())
        if parsed is not None:
            return self._rest(parsed[0]), []
        assert self._scan is not None
        after = self._text[self._scan:]
        for tag in self._parser.tags:
            after = after.replace(tag, "")
        after = after.strip()
        return (f"\n{after}" if after and self._sent else after), []

    def _content(self, since: int) -> str:
        """The content to send now; holds the text from where a call may begin (a marker
        found from ``since``: the text before it was read for them already)."""
        opened = min((at for at in (self._text.find(m, since) for m in self._parser.markers)
                      if at >= 0), default=-1)
        bare = self._parser.bare
        if opened >= 0 or (not self._sent and bare is not None
                           and self._text.lstrip().startswith(bare)):
            self._scan = max(opened, 0)
            return self._send(self._text[:opened].rstrip() if opened >= 0 else "")
        if not self._text.strip():
            return ""  # whitespace so far: a call may follow
        # Hold a tail that may be the start of a marker, and whitespace before it.
        safe = self._text
        held = max((size for marker in self._parser.markers
                    for size in range(1, min(len(marker) - 1, len(safe)) + 1)
                    if marker.startswith(safe[-size:])), default=0)
        return self._send(safe[:len(safe) - held].rstrip())

    def _stream(self) -> list[CallDelta]:
        """The calls that formed further in the held text (those of the functions only; a
        call of anything else ends the streaming, and the end decides)."""
        assert self._scan is not None
        deltas: list[CallDelta] = []
        names = {f.name for f in self._functions}
        while True:
            if self._open is not None:
                end = self._open.read(self._text)
                deltas += self._grow(self._text[self._open.start:end])
                if end is None:
                    break
                closing = _CALL_CLOSE.match(self._text, end)  # the call object's own brace
                self._open, self._scan = None, closing.end() if closing else end
            if self.calls and not self._parallel:
                break
            head = self._parser.next_call(self._text, self._scan)
            if head is None or head[0] not in names:
                break
            self.calls.append(new_call(head[0], ""))
            self._open = ObjectEnd(head[1])
            deltas.append(CallDelta(len(self.calls) - 1, self.calls[-1], True, ""))
        return merged(deltas)

    def _grow(self, arguments: str) -> list[CallDelta]:
        call = self.calls[-1]
        new = arguments[len(call.arguments):]
        if not new:
            return []
        self.calls[-1] = ToolCall(call.id, call.name, call.arguments + new)
        return [CallDelta(len(self.calls) - 1, self.calls[-1], False, new)]

    def _rest(self, content: str | None) -> str:
        sent = self._sent.strip()
        return (content or "")[len(sent):] if (content or "").startswith(sent) else ""

    def _send(self, upto: str) -> str:
        new = upto[len(self._sent):] if upto.startswith(self._sent) else ""
        self._sent += new
        return new


class CallStream:
    """A reply held to one call (``tool_choice`` required, or a named function, whose reply is
    the arguments), read as it streams: the call's id and name as soon as they are known, then
    its arguments' JSON text as it forms, until their object closes (OpenAI's streamed
    ``tool_calls`` deltas). ``call`` is the call so far: its ``arguments`` grow with each
    ``feed``. Required: the reply is ``{"name": ..., "arguments": {...}}``."""

    def __init__(self, name: str | None) -> None:
        self._name = name  # None: read from the reply
        self._text = ""
        self._arguments = ObjectEnd(0)  # where they begin in the text, and end
        self.call: ToolCall | None = None

    @property
    def text(self) -> str:
        """The reply so far."""
        return self._text

    def feed(self, text: str) -> tuple[bool, str]:
        """Whether the call started with this text, and the arguments' new text."""
        self._text += text
        started = False
        if self.call is None:
            if self._name is not None:
                self.call = new_call(self._name, "")
            else:
                head = HERMES.next_call(self._text, 0)
                if head is None:
                    return False, ""
                self.call = new_call(head[0], "")
                self._arguments = ObjectEnd(head[1])
            started = True
        end = self._arguments.read(self._text)
        return started, self._grow(self._text[self._arguments.start:end])

    def finish(self) -> str:
        """The arguments' last text: a reply cut short sends them as far as they came."""
        if self.call is None or self._arguments.read(self._text) is not None:
            return ""
        return self._grow(self._text[self._arguments.start:].rstrip())

    def _grow(self, arguments: str) -> str:
        assert self.call is not None
        new = arguments[len(self.call.arguments):]
        if new:
            self.call = ToolCall(self.call.id, self.call.name, self.call.arguments + new)
        return new


class ObjectEnd:
    """Where the JSON object or array that begins at ``start`` (after whitespace) ends in a
    text that grows: ``read`` it again as it grows (each character is read once)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._at, self._depth, self._quoted, self._escaped = start, 0, False, False
        self._end: int | None = None

    def read(self, text: str) -> int | None:
        """Where it ends; None: not closed yet."""
        if self._end is not None:
            return self._end
        depth, quoted, escaped = self._depth, self._quoted, self._escaped
        for at in range(self._at, len(text)):
            char = text[at]
            if quoted:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    quoted = False
            elif char == '"':
                quoted = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self._end = at + 1
                    return self._end
        self._at, self._depth, self._quoted, self._escaped = len(text), depth, quoted, escaped
        return None
