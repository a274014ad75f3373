"""The prefill span of one request, its phases derived from what the engine reports.

The engine knows nothing of tracing: the worker notes when the engine thread took the request
(and how many requests were waiting and running then) and when the first token came out; the
number of prefill chunks follows from the uncached prompt tokens and the per-step budget.
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind

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
