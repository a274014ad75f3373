"""The streaming path shared by HTTP and gRPC: backend outputs in, text deltas out.

Per engine step it detokenizes incrementally, applies stop strings (closing the backend stream,
which aborts the request and frees its KV blocks) and records the request's metrics. Leaving the
stream early for any reason (client gone, cancellation) closes the backend stream the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.gateway.backend import GenerationBackend
from tandem.services.gateway.errors import GatewayError, from_backend
from tandem.services.gateway.metrics import ERROR, RequestTimer, failure_reason
from tandem.services.protocol.outputs import DeadlineExceededError, RequestOutput, TokenLogprobs
from tandem.services.protocol.request import GenerationRequest

log = logging.getLogger(__name__)

# A call the front end ends this close to its deadline, or later, timed out.
DEADLINE_SLACK_S = 0.05


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Delta:
    """What one engine step added to a request's output."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if requested
    text_offsets: list[int] = field(default_factory=list)  # per token: where its text starts
    finish_reason: str | None = None  # stop | length | abort, on the last delta only
    stop_string: str | None = None  # the stop string that ended it (finish_reason stop)
    usage: Usage | None = None  # on the last delta only
    # The prompt's logprobs (SamplingParams.prompt_logprobs), on the first delta only: entry i
    # is prompt token i + 1's.
    prompt_logprobs: list[TokenLogprobs] | None = None


async def generate_deltas(backend: GenerationBackend, tokenizer: Tokenizer,
                          request: GenerationRequest, timer: RequestTimer,
                          retry_after_s: int = 1, keep: frozenset[int] = frozenset()
                          ) -> AsyncGenerator[Delta, None]:
    """Stream deltas; backend rejections surface as ``GatewayError`` on the first ``anext``,
    later failures (an engine fault, the deadline) as ``GatewayError`` on a later one. When
    the request's deadline passes, the backend stream is closed (the request is aborted on
    every worker) and a 504 ``GatewayError`` raised. ``keep``: special tokens whose text is
    kept (``IncrementalDetokenizer``)."""
    detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, keep=keep)
    stops = StopStringMatcher(request.stop)
    num_prompt, num_output, num_cached = len(request.prompt_token_ids), 0, 0
    emitted = 0  # characters of text handed out so far
    started = False
    finish: str | None = None
    stream = backend.generate(request)
    loop = asyncio.get_running_loop()
    remaining = request.remaining_s()
    deadline = None if remaining is None else loop.time() + remaining
    try:
        async with contextlib.aclosing(stream):
            while finish is None:
                try:
                    async with asyncio.timeout_at(deadline):
                        out = await anext(stream)
                except StopAsyncIteration:
                    out = None
                except Exception as exc:
                    if isinstance(exc, TimeoutError) and not isinstance(
                            exc, DeadlineExceededError):  # ours: the request's deadline
                        exc = _deadline_exceeded(request)
                    error = _failed(exc, timer, retry_after_s)
                    if error is exc:
                        raise
                    raise error from exc
                delta = Delta()
                if out is not None and not started:
                    delta.prompt_logprobs = out.prompt_logprobs
                started = True
                if out is None:
                    finish = "abort"  # the backend ended the stream without finishing it
                else:
                    finish = _apply_output(out, delta, detok, stops, emitted)
                    num_output += len(delta.token_ids)
                    num_cached = out.num_cached_tokens
                    timer.tokens(len(delta.token_ids))
                emitted += len(delta.text)
                if finish is not None:
                    # Abort (a stop string) or release the request before the client hears of it.
                    await stream.aclose()
                    timer.end(finish, num_prompt, num_output)
                    delta.finish_reason = finish
                    delta.usage = Usage(num_prompt, num_output, num_cached)
                if delta.token_ids or delta.text or finish is not None:
                    yield delta
    except Exception:
        timer.fail(ERROR)  # a no-op after the failures counted above
        raise
    finally:
        if (not timer.ended and deadline is not None
                and loop.time() >= deadline - DEADLINE_SLACK_S):
            # The front end ended the call at its deadline (a gRPC server cancels it then,
            # perhaps just before our own timer fires): that is this request's timeout.
            _failed(_deadline_exceeded(request), timer, retry_after_s)
        if started:  # ended early: the client left or the call was cancelled
            timer.end("abort", num_prompt, num_output)


def _deadline_exceeded(request: GenerationRequest) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"request {request.request_id} did not finish within its deadline")


def _failed(exc: BaseException, timer: RequestTimer, retry_after_s: int) -> BaseException:
    """Count the failure by its reason; the client-facing error, or ``exc`` itself if it is
    unexpected (then the front end logs it)."""
    error = from_backend(exc, retry_after_s) if not isinstance(exc, GatewayError) else exc
    timer.fail(failure_reason(error) if error is not None else ERROR)
    if error is not None and error.status == 504:
        log.warning("%s", error.message)  # nobody else logs a timeout
    return error if error is not None else exc


def _apply_output(out: RequestOutput, delta: Delta, detok: IncrementalDetokenizer,
                  stops: StopStringMatcher, emitted: int) -> str | None:
    """Fill ``delta`` from one backend output; returns the finish reason once there is one."""
    for i, token in enumerate(out.new_token_ids):
        delta.token_ids.append(token)
        if i < len(out.new_logprobs):
            delta.logprobs.append(out.new_logprobs[i])
        delta.text_offsets.append(emitted + len(delta.text))
        result = stops.feed(detok.push(token))
        delta.text += result.text
        if result.stopped:
            delta.stop_string = stops.matched
            return "stop"  # tokens after the stop string are dropped
    if not out.finished:
        return None
    result = stops.feed(detok.flush())
    delta.text += result.text + stops.flush()
    delta.stop_string = stops.matched
    return "stop" if result.stopped else str(out.finish_reason or "stop")


# -- Incremental detokenization ----------------------------------------------------------------
# Incremental detokenization that never emits part of a UTF-8 character. Byte-level BPE tokens
# can end in the middle of a multi-byte character; decoding such a prefix gives U+FFFD. The text
# after a window of recent tokens is held back until a later token completes the character.
# Decoding a few tokens of context before the new ones also keeps tokenizers that drop a leading
# space on the first decoded token (SentencePiece) right.


_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> None:
        """``keep``: special tokens whose text is kept though the others are skipped (a
        tool-call parser's tags: ``tool_parsers.ToolParser.token_ids``)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._keep = keep
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this are emitted

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (may be empty)."""
        self._ids.append(token_id)
        prefix_text, full_text = self._window_texts()
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text still held back (a dangling partial character decodes as U+FFFD)."""
        prefix_text, full_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        prefix = self._decode(window[:self._read_offset - self._prefix_offset])
        return prefix, self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        """``ids``' text; the kept tokens' text between the runs of the others'."""
        decode = self._tokenizer.decode
        if not self._skip_special or not self._keep.intersection(ids):
            return decode(ids, self._skip_special)
        text, run = "", []
        for token in ids:
            if token in self._keep:
                text += decode(run, True) + decode([token], False)
                run = []
            else:
                run.append(token)
        return text + decode(run, True)


# -- Stop strings ------------------------------------------------------------------------------
# Stop strings over streamed text: emit what cannot be the start of a stop, hold the rest.


@dataclass
class StopResult:
    text: str  # safe to emit now
    stopped: bool  # a stop string was found; ``text`` ends right before it


class StopStringMatcher:
    """Finds stop strings in streamed text in linear time: one Knuth-Morris-Pratt automaton per
    stop string, fed each character once. Text that may still begin a stop string (the longest
    partial match, shorter than the longest stop) is held back; the rest is emitted."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)  # each stop's longest prefix ending the text so far
        self._pending = ""  # text not emitted yet: a possible start of a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest to start)

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        if not self._stops:
            return StopResult(text, False)
        pending = self._pending + text
        first = None  # the earliest start of a stop string found in ``pending``
        offset = len(self._pending)
        for i, char in enumerate(text):
            for j, stop in enumerate(self._stops):
                k, fail = self._state[j], self._fail[j]
                while k and stop[k] != char:
                    k = fail[k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    start = offset + i + 1 - k
                    if first is None or start < first:
                        first, self.matched = start, stop
                    k = fail[k - 1]
                self._state[j] = k
        if first is not None:
            self.stopped = True
            self._pending = ""
            return StopResult(pending[:first], True)
        hold = max(self._state)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return StopResult(pending[:len(pending) - hold], False)

    def flush(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        text, self._pending = ("" if self.stopped else self._pending), ""
        return text


def _failure(stop: str) -> list[int]:
    """KMP's table: for each prefix of ``stop``, its longest proper suffix that is a prefix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail
