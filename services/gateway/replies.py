"""A chat reply read as it streams, delta by delta: its reasoning apart (``reasoning.py``), its
content, and its tool calls (``tools.py``) as they form: under ``auto`` content until a call
may begin, then each call's id and name and its arguments' text (whole at the end in the
families whose arguments are not JSON text); a reply held to one call (``required``, a named
function) is that call's deltas. What every front end sends, each in its own shape (chat
chunks, Responses and Messages events, gRPC messages)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.gateway.pipeline import Delta
from tandem.services.gateway.reasoning import ReasoningStream
from tandem.services.gateway.tool_parsers import ToolParser
from tandem.services.gateway.tools import (
    CallDelta,
    CallStream,
    Function,
    ReplyStream,
    ToolCall,
    merged,
)


@dataclass
class Piece:
    """What one delta adds to a reply."""

    reasoning: str
    content: str
    calls: list[CallDelta]  # what it adds to the reply's tool calls
    last: Delta | None  # the last delta (finish reason, stop string, usage); None before


class ReplyReader:
    """One reply's deltas into pieces. ``mode``: None (no tools), none, auto, required or a
    function's name; ``thinking``: whether the reply starts inside reasoning (None: reasoning
    is not parsed); ``parallel``: false keeps the first call only."""

    def __init__(self, functions: list[Function], mode: str | None, thinking: bool | None,
                 parser: ToolParser, parallel: bool = True) -> None:
        self._thought = None if thinking is None else ReasoningStream(thinking)
        self._reply = ReplyStream(functions, parser, parallel) if mode == "auto" else None
        self._call = (CallStream(None if mode == "required" else mode)
                      if mode not in (None, "none", "auto") else None)

    @property
    def calls(self) -> list[ToolCall]:
        """The reply's tool calls so far (all of them once the last delta was read)."""
        if self._reply is not None:
            return self._reply.calls
        return [self._call.call] if self._call is not None and self._call.call else []

    def read(self, delta: Delta) -> Piece:
        last = delta.finish_reason is not None
        reasoning, content = delta_reasoning(self._thought, delta)
        calls: list[CallDelta] = []
        if self._reply is not None:
            content, calls = self._reply.feed(content)
            if last:
                rest, more = self._reply.finish()
                content, calls = content + rest, merged(calls + more)
        elif self._call is not None:
            started, arguments = self._call.feed(content)
            content = ""
            if last:
                arguments += self._call.finish()
                if self._call.call is None:  # cut short before the call began
                    content = self._call.text
            if self._call.call is not None and (started or arguments):
                calls = [CallDelta(0, self._call.call, started, arguments)]
        return Piece(reasoning, content, calls, delta if last else None)


def delta_reasoning(stream: ReasoningStream | None, delta: Delta) -> tuple[str, str]:
    """A delta's reasoning and the rest of its text."""
    if stream is None:
        return "", delta.text
    reasoning, text = stream.feed(delta.text)
    if delta.finish_reason is not None:
        more_reasoning, more_text = stream.finish()
        reasoning, text = reasoning + more_reasoning, text + more_text
    return reasoning, text
