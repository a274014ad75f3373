"""OpenAI response objects (JSON-ready dicts) built from the pipeline's deltas."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.services.gateway.pipeline import Delta, Usage
from tandem.services.gateway.token_text import TokenText
from tandem.services.gateway.tools import CallStream, ToolCall
from tandem.services.protocol.outputs import TokenLogprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                             separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _finish(reason: str | None, calls: Sequence[ToolCall]) -> str | None:
    """A reply that ended on its own with tool calls finishes as ``tool_calls``."""
    return "tool_calls" if calls and reason == "stop" else reason


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


@dataclass
class ResponseContext:
    """What every response object of one request repeats."""

    id: str
    created: int
    model: str
    token_text: TokenText
    return_token_ids: bool = False

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def with_token_ids(self, choice: dict[str, Any], delta: Delta | None) -> dict[str, Any]:
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids if delta is not None else []
        return choice

    # -- chat ---------------------------------------------------------------------------

    def chat_logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.token_text.text(token_id), "logprob": _lp(logprob),
                    "bytes": self.token_text.bytes(token_id)}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    def chat_choice(self, delta: Delta, want_logprobs: bool, index: int = 0,
                    reply: tuple[str | None, Sequence[ToolCall]] | None = None,
                    reasoning: str | None = None) -> dict[str, Any]:
        """``reply``: the choice's text parsed for tool calls (none: its text); ``reasoning``:
        its reasoning, apart (gateway/reasoning.py)."""
        content, calls = reply if reply is not None else (delta.text, ())
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_json() for call in calls]
        return self.with_token_ids({
            "index": index,
            "message": message,
            "logprobs": self.chat_logprobs(delta.logprobs) if want_logprobs else None,
            "finish_reason": _finish(delta.finish_reason, calls),
        }, delta)

    def chat_completion(self, choices: list[dict[str, Any]], usage: Usage | None,
                        prompt_token_ids: list[int]) -> dict[str, Any]:
        body = self.envelope("chat.completion", choices)
        body["usage"] = usage_json(usage)
        if self.return_token_ids:
            body["prompt_token_ids"] = prompt_token_ids
        return body

    def chat_chunk(self, delta: Delta | None, want_logprobs: bool, first: bool = False,
                   reply: tuple[str | None, Sequence[ToolCall]] | None = None, index: int = 0,
                   reasoning: str = "") -> dict[str, Any]:
        """``reply``: the delta's content and the reply's tool calls (none: the delta's text);
        ``reasoning``: the delta's reasoning text."""
        message: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        choice: dict[str, Any] = {"index": index, "delta": message, "logprobs": None,
                                  "finish_reason": None}
        if delta is not None:
            content, calls = reply if reply is not None else (delta.text, ())
            text = content
            if reasoning:
                message["reasoning_content"] = reasoning
            if text:
                message["content"] = text
            if calls:
                message["tool_calls"] = [call.to_json(i) for i, call in enumerate(calls)]
            if want_logprobs and delta.logprobs:
                choice["logprobs"] = self.chat_logprobs(delta.logprobs)
            choice["finish_reason"] = _finish(delta.finish_reason, calls)
        self.with_token_ids(choice, delta)
        return self.envelope("chat.completion.chunk", [choice])

    def call_chunk(self, delta: Delta, want_logprobs: bool, index: int, stream: CallStream,
                   started: bool, arguments: str) -> dict[str, Any]:
        """A chunk of a reply held to one tool call (``tools.CallStream``): the call's id and
        name when it ``started``, then its new ``arguments`` text. A reply that ended before
        a call began (cut short) is sent as content at its end."""
        message: dict[str, Any] = {}
        call = stream.call
        if call is None:
            if delta.finish_reason is not None and stream.text:
                message["content"] = stream.text
        elif started or arguments:
            function: dict[str, Any] = {"arguments": arguments}
            entry: dict[str, Any] = {"index": 0, "function": function}
            if started:
                entry.update(id=call.id, type="function")
                function["name"] = call.name
            message["tool_calls"] = [entry]
        choice: dict[str, Any] = {
            "index": index, "delta": message,
            "logprobs": (self.chat_logprobs(delta.logprobs)
                         if want_logprobs and delta.logprobs else None),
            "finish_reason": _finish(delta.finish_reason, [call] if call else [])}
        self.with_token_ids(choice, delta)
        return self.envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, obj: str, usage: Usage | None) -> dict[str, Any]:
        body = self.envelope(obj, [])
        body["usage"] = usage_json(usage)
        return body

    # -- completions --------------------------------------------------------------------

    def completion_logprobs(self, delta: Delta) -> dict[str, Any]:
        tt = self.token_text
        return {
            "tokens": [tt.text(lp.token_id) for lp in delta.logprobs],
            "token_logprobs": [_lp(lp.logprob) for lp in delta.logprobs],
            "top_logprobs": [{tt.text(t): _lp(v) for t, v in lp.top} for lp in delta.logprobs],
            "text_offset": delta.text_offsets[:len(delta.logprobs)],
        }

    def echoed_logprobs(self, prompt_token_ids: list[int],
                        prompt_logprobs: Sequence[TokenLogprobs] | None,
                        then: dict[str, Any] | None = None) -> dict[str, Any]:
        """``echo`` with ``logprobs``: the prompt's tokens and logprobs (the first token has
        none), followed by ``then`` (the completion's, offsets already after the prompt)."""
        tt = self.token_text
        texts = [tt.text(t) for t in prompt_token_ids]
        lps = list(prompt_logprobs or ())
        then = then or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                        "text_offset": []}
        return {
            "tokens": texts + then["tokens"],
            "token_logprobs": [None, *(_lp(lp.logprob) for lp in lps)] + then["token_logprobs"],
            "top_logprobs": [None, *({tt.text(t): _lp(v) for t, v in lp.top} for lp in lps)]
            + then["top_logprobs"],
            "text_offset": list(itertools.accumulate((len(t) for t in texts[:-1]), initial=0))
            + then["text_offset"],
        }

    def completion_choice(self, delta: Delta, want_logprobs: bool, index: int = 0
                          ) -> dict[str, Any]:
        return self.with_token_ids({
            "index": index,
            "text": delta.text,
            "logprobs": self.completion_logprobs(delta) if want_logprobs else None,
            "finish_reason": delta.finish_reason,
        }, delta)

    def completion(self, choices: list[dict[str, Any]], usage: Usage | None,
                   prompt_token_ids: list[int]) -> dict[str, Any]:
        body = self.envelope("text_completion", choices)
        body["usage"] = usage_json(usage)
        if self.return_token_ids:
            body["prompt_token_ids"] = prompt_token_ids
        return body

    def completion_chunk(self, delta: Delta, want_logprobs: bool, index: int = 0
                         ) -> dict[str, Any]:
        return self.envelope("text_completion",
                             [self.completion_choice(delta, want_logprobs, index)])
