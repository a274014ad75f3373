"""The prefill and decode spans of one request, seen from the workers.

Prefill: the prefill span of one request, its phases derived from what the engine reports.

The engine knows nothing of tracing: the worker notes when the engine thread took the request
(and how many requests were waiting and running then) and when the first token came out; the
number of prefill chunks follows from the uncached prompt tokens and the per-step budget.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from tandem.services import tracing
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.protocol.handoff import PrefillResult
from tandem.services.protocol.outputs import RequestOutput


class PrefillTrace:
    def __init__(self, request_id: str, worker_id: str, num_prompt_tokens: int) -> None:
        self.arrived_ns = time.time_ns()
        self.span = tracing.start_span("prefill", kind=SpanKind.SERVER, start_ns=self.arrived_ns)
        self.recording = self.span.is_recording()
        self._admitted: tuple[int, int, int] | None = None  # (time, waiting, running)
        if self.recording:
            self.span.set_attributes({"tandem.request_id": request_id,
                                      "tandem.worker_id": worker_id,
                                      "tandem.prompt_tokens": num_prompt_tokens})

    def admitted(self, engine: LLMEngine) -> None:
        """On the engine thread, just before the request joins its queue."""
        stats = engine.stats
        self._admitted = (time.time_ns(), stats.num_waiting, stats.num_running)

    def first_token(self, out: RequestOutput, chunk_tokens: int) -> None:
        if not self.recording:
            return
        now = time.time_ns()
        admitted, waiting, running = self._admitted or (self.arrived_ns, 0, 0)
        tracing.record_span(self.span, "prefill.queue", self.arrived_ns, admitted,
                            {"tandem.engine.waiting": waiting, "tandem.engine.running": running})
        computed = out.num_prompt_tokens - out.num_cached_tokens
        tracing.record_span(self.span, "prefill.chunks", admitted, now, {
            "tandem.prefill.computed_tokens": computed,
            "tandem.prefill.chunk_tokens": chunk_tokens,
            "tandem.prefill.chunks": -(-computed // chunk_tokens)})
        self.span.add_event("first_token", timestamp=now)
        self.span.set_attribute("tandem.cached_tokens", out.num_cached_tokens)

    def finish(self, result: PrefillResult) -> None:
        if self.recording:
            self.span.set_attributes({
                "tandem.lease_id": "" if result.kv is None else result.kv.lease_id,
                "tandem.kv.blocks": 0 if result.kv is None else len(result.kv.block_ids),
                "tandem.finish_reason": result.finish_reason or ""})
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        tracing.end_with_error(self.span, exc)


MAX_STEP_EVENTS = 32  # per request: a long generation must not make a huge span


# The decode span of one request: its KV transfer, its wait for the first decode step, its
# steps and how it finished, all seen from the worker (the engine knows nothing of tracing).
#
#     decode
#     ├── kv_transfer       reserve blocks, READ them from P, confirm the lease (bytes, blocks)
#     ├── decode.queue      KV in place (or prompt queued) -> first output of the engine
#     └── decode.steps      first -> last output; one ``step`` event per output, at most
#                           MAX_STEP_EVENTS; the ``finish`` event is on ``decode``


class DecodeTrace:
    def __init__(self, request_id: str, worker_id: str, num_prompt_tokens: int) -> None:
        self.span = tracing.start_span("decode", kind=SpanKind.SERVER)
        self.recording = self.span.is_recording()
        self._queued_ns = 0
        self._steps: Span = INVALID_SPAN
        self._last_ns = 0
        self._outputs = 0
        self._tokens = 0
        self._max_gap_ns = 0
        self._ended = False
        if self.recording:
            self.span.set_attributes({"tandem.request_id": request_id,
                                      "tandem.worker_id": worker_id,
                                      "tandem.prompt_tokens": num_prompt_tokens})

    def transfer(self) -> Span:
        """The ``kv_transfer`` span (the caller ends it)."""
        return tracing.start_span("kv_transfer", self.span)

    def queued(self, kv_source: str) -> None:
        """The request is handed to the engine (KV committed, recomputing, or a local prompt)."""
        self._queued_ns = time.time_ns()
        if self.recording:
            self.span.set_attribute("tandem.kv.source", kv_source)

    def output(self, out: RequestOutput) -> None:
        now = time.time_ns()
        if self._outputs == 0:
            tracing.record_span(self.span, "decode.queue", self._queued_ns or now, now)
            self._steps = tracing.start_span("decode.steps", self.span, start_ns=now)
        else:
            self._max_gap_ns = max(self._max_gap_ns, now - self._last_ns)
        self._outputs += 1
        self._tokens += len(out.new_token_ids)
        self._last_ns = now
        if self._outputs <= MAX_STEP_EVENTS:
            self._steps.add_event("step", {"tandem.tokens": len(out.new_token_ids),
                                           "tandem.output_tokens": out.num_output_tokens},
                                  timestamp=now)
        if out.finished:
            self.end(str(out.finish_reason), out.num_output_tokens)

    def end(self, finish_reason: str, output_tokens: int | None = None) -> None:
        """The request left this worker: finished, aborted (``abort``) or failed."""
        if self._ended:
            return
        self._ended = True
        if self._outputs:
            self._steps.set_attributes({
                "tandem.decode.outputs": self._outputs, "tandem.decode.tokens": self._tokens,
                "tandem.decode.max_gap_ms": self._max_gap_ns / 1e6,
                "tandem.decode.step_events_dropped": max(0, self._outputs - MAX_STEP_EVENTS)})
            self._steps.end(end_time=self._last_ns)
        attributes: dict[str, str | int] = {"tandem.finish_reason": finish_reason}
        if output_tokens is not None:
            attributes["tandem.output_tokens"] = output_tokens
        self.span.add_event("finish", attributes)
        self.span.set_attribute("tandem.finish_reason", finish_reason)
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        if self._ended:
            return
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.end("abort")
            return
        self._ended = True
        if self._outputs:
            self._steps.end(end_time=self._last_ns)
        tracing.end_with_error(self.span, exc)
