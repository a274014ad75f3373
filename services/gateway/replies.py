"""A chat reply read as it streams, delta by delta: its reasoning apart (``reasoning.py``), its
content, and its tool calls (``tools.py``): under ``auto`` content until a call may begin and the
calls with the last delta; a reply held to one call (``required``, a named function) read whole
at the end. What every front end sends, each in its own shape (chat chunks, Responses and
Messages events, gRPC messages)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.gateway.pipeline import Delta
from tandem.services.gateway.reasoning import ReasoningStream
from tandem.services.gateway.tool_parsers import ToolParser
from tandem.services.gateway.tools import Function, ReplyStream, ToolCall, parse_reply


@dataclass
class Piece:
    """What one delta adds to a reply."""

    reasoning: str
    content: str
    calls: list[ToolCall]  # with the last delta only
    last: Delta | None  # the last delta (finish reason, stop string, usage); None before


class ReplyReader:
    """One reply's deltas into pieces. ``mode``: None (no tools), none, auto, required or a
    function's name; ``thinking``: whether the reply starts inside reasoning (None: reasoning
    is not parsed); ``parallel``: false keeps the first call only."""

    def __init__(self, functions: list[Function], mode: str | None, thinking: bool | None,
                 parser: ToolParser, parallel: bool = True) -> None:
        self._functions = functions
        self._mode = mode
        self._thought = None if thinking is None else ReasoningStream(thinking)
        self._reply = (ReplyStream(functions, parser, parallel) if mode == "auto" else None)
        self._held = ""  # a reply held to one call

    def read(self, delta: Delta) -> Piece:
        last = delta.finish_reason is not None
        reasoning, text = delta_reasoning(self._thought, delta)
        calls: list[ToolCall] = []
        if self._mode in (None, "none"):
            content = text
        elif self._reply is not None:
            content = self._reply.feed(text)
            if last:
                rest, calls = self._reply.finish()
                content += rest
        else:
            self._held += text
            content = ""
            if last:
                parsed, calls = parse_reply(self._held, self._functions, self._mode)
                content = parsed or ""
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
