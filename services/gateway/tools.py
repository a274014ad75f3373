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

# The start of a reply held to {"name": ..., "arguments": ...} (tool_choice required).
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"[}\s]*\Z")  # what may be the end of the call object, not its arguments
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


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
    """``choice``: none, auto, required, or a function's name."""
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": f.name}, "arguments": f.schema()}}
                 for f in functions]
        return StructuredOutput("json", json.dumps(calls[0] if len(calls) == 1
                                                   else {"anyOf": calls}))
    function = next(f for f in functions if f.name == choice)
    return StructuredOutput("json", json.dumps(function.schema()))


def parse_reply(text: str, functions: list[Function], choice: str | None,
                parser: ToolParser = HERMES, parallel: bool = True
                ) -> tuple[str | None, list[ToolCall]]:
    """The reply's content and its tool calls (none: the text is all content). Under auto
    the family's ``parser`` reads it; ``parallel`` false (``parallel_tool_calls``): the first
    call only."""
    if choice in (None, "none"):
        return text, []
    if choice != "auto":  # required or a named function: one call, as CallStream reads it
        stream = CallStream(None if choice == "required" else choice)
        stream.feed(text)
        stream.finish(complete=_is_json(text))
        return (None, [stream.call]) if stream.call is not None else (text, [])
    found = parser.parse(text, {f.name: f.schema() for f in functions})
    if found is None:
        return text, []  # no well-formed call: the text as it is
    content, calls = found
    return content or None, [new_call(name, arguments)
                             for name, arguments in calls[:None if parallel else 1]]


class ReplyStream:
    """A reply under ``tool_choice`` auto, read as it streams: its text goes out as content
    until a call may be starting (one of the parser's markers, or a reply that opens as its
    calls may: ``{`` or ``[``); from there it is held, and at the end parsed as
    ``parse_reply`` does: the calls, and the content not yet sent (or, if the calls are
    malformed, the held text as content)."""

    def __init__(self, functions: list[Function], parser: ToolParser = HERMES,
                 parallel: bool = True) -> None:
        self._functions = functions
        self._parser = parser
        self._parallel = parallel
        self._text = ""
        self._sent = ""  # content already sent: a prefix of the text
        self._held = False

    def feed(self, text: str) -> str:
        """The content to send now."""
        self._text += text
        if self._held:
            return ""
        opened = min((at for at in map(self._text.find, self._parser.markers) if at >= 0),
                     default=-1)
        bare = self._parser.bare
        if opened >= 0 or (not self._sent and bare is not None
                           and self._text.lstrip().startswith(bare)):
            self._held = True
            return self._send(self._text[:opened].rstrip() if opened >= 0 else "")
        if not self._text.strip():
            return ""  # whitespace so far: a call may follow
        # Hold a tail that may be the start of a marker, and whitespace before it.
        safe = self._text
        held = max((size for marker in self._parser.markers
                    for size in range(1, min(len(marker) - 1, len(safe)) + 1)
                    if marker.startswith(safe[-size:])), default=0)
        return self._send(safe[:len(safe) - held].rstrip())

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still to send and the reply's tool calls."""
        content, calls = parse_reply(self._text, self._functions, "auto", self._parser,
                                     self._parallel)
        if not calls:
            return self._text[len(self._sent):], []
        sent = self._sent.strip()
        rest = (content or "")[len(sent):] if (content or "").startswith(sent) else ""
        return rest, calls

    def _send(self, upto: str) -> str:
        new = upto[len(self._sent):] if upto.startswith(self._sent) else ""
        self._sent += new
        return new


class CallStream:
    """A reply held to one call (``tool_choice`` required, or a named function, whose reply is
    the arguments), read as it streams: the call's id and name as soon as they are known, then
    its arguments' JSON text as it forms (OpenAI's streamed ``tool_calls`` deltas).

    ``call`` is the call so far: its ``arguments`` grow with each ``feed``. Required: the reply
    is ``{"name": ..., "arguments": {...}}``; the trailing braces are held back until more text
    shows they are the arguments' own, and the call object's last one is dropped at ``finish``.
    """

    def __init__(self, name: str | None) -> None:
        self._name = name  # None: read from the reply
        self._text = ""
        self._start = 0  # where the arguments begin in the text
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
                head = _CALL_HEAD.match(self._text)
                if head is None:
                    return False, ""
                self.call = new_call(json.loads(head.group(1)), "")
                self._start = head.end()
            started = True
        arguments = self._text[self._start:]
        if self._name is None:
            arguments = arguments[:_TAIL.search(arguments).start()]  # type: ignore[union-attr]
        return started, self._grow(arguments)

    def finish(self, complete: bool) -> str:
        """The arguments' last text. ``complete``: the reply ended as the grammar allows (the
        call object's closing brace is there); else it was cut short and is sent as it is."""
        if self.call is None:
            return ""
        arguments = self._text[self._start:]
        if self._name is None and complete:
            arguments = arguments.rstrip()[:-1].rstrip()  # the call object's "}"
        return self._grow(arguments)

    def _grow(self, arguments: str) -> str:
        assert self.call is not None
        new = arguments[len(self.call.arguments):]
        if new:
            self.call = ToolCall(self.call.id, self.call.name, self.call.arguments + new)
        return new


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True

