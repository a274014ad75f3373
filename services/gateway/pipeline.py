"""The streaming path shared by HTTP and gRPC: backend outputs in, text deltas out.

Per engine step it detokenizes incrementally, applies stop strings (closing the backend stream,
which aborts the request and frees its KV blocks) and records the request's metrics. Leaving the
stream early for any reason (client gone, cancellation) closes the backend stream the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from services.engine.outputs import EngineOverloadedError, RequestError, RequestOutput
from services.engine.sequence import TokenLogprobs
from services.engine.tokenizer import Tokenizer
from services.gateway.backend import GenerationBackend
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import from_backend
from services.gateway.metrics import ERROR, INVALID, REJECTED, RequestTimer
from services.gateway.stop_strings import StopStringMatcher
from services.request import GenerationRequest


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
    usage: Usage | None = None  # on the last delta only


async def generate_deltas(backend: GenerationBackend, tokenizer: Tokenizer,
                          request: GenerationRequest, timer: RequestTimer,
                          retry_after_s: int = 1) -> AsyncGenerator[Delta, None]:
    """Stream deltas; backend rejections surface as ``GatewayError`` on the first ``anext``."""
    detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
    stops = StopStringMatcher(request.stop)
    num_prompt, num_output, num_cached = len(request.prompt_token_ids), 0, 0
    emitted = 0  # characters of text handed out so far
    started = False
    finish: str | None = None
    stream = backend.generate(request)
    try:
        async with contextlib.aclosing(stream):
            while finish is None:
                try:
                    out = await anext(stream)
                except StopAsyncIteration:
                    out = None
                except (RequestError, EngineOverloadedError) as exc:
                    error = from_backend(exc, retry_after_s)
                    assert error is not None
                    timer.fail(REJECTED if error.status == 429 else INVALID)
                    raise error from exc
                started = True
                delta = Delta()
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
        if started:  # ended early: the client left or the call was cancelled
            timer.end("abort", num_prompt, num_output)


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
            return "stop"  # tokens after the stop string are dropped
    if not out.finished:
        return None
    result = stops.feed(detok.flush())
    delta.text += result.text + stops.flush()
    return "stop" if result.stopped else str(out.finish_reason or "stop")
