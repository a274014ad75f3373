"""The gateway's span of one request: the root of its trace (or a child of the client's
``traceparent``), with parse and tokenize phases; the backend's router, prefill and decode
spans hang under it. It ends when the generation does (finished, aborted or failed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from tandem.services import tracing
from tandem.services.gateway.errors import GatewayError
from tandem.services.gateway.pipeline import Delta
from tandem.services.protocol.request import GenerationRequest


class RequestTrace:
    def __init__(self, entry: str, operation: str, carrier: Mapping[str, Any] | None) -> None:
        """``entry``: http or grpc; ``carrier``: the request's headers or metadata."""
        self.span = tracing.start_span("gateway.request", tracing.extract(carrier),
                                       SpanKind.SERVER)
        self.recording = self.span.is_recording()
        self._ended = False
        self._finished = False
        if self.recording:
            self.span.set_attributes({"tandem.entry": entry, "tandem.operation": operation})

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """A child span around a block of the gateway's own work (not across a ``yield``)."""
        if not self.recording:
            yield INVALID_SPAN
            return
        # What went wrong is recorded once, on the request span (see fail).
        with tracing.tracer().start_as_current_span(
                name, context=trace.set_span_in_context(self.span), record_exception=False,
                set_status_on_exception=False) as span:
            yield span

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The request span as the current one: the backend parents its spans on it."""
        if not self.recording:
            yield
            return
        with trace.use_span(self.span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            yield

    @contextlib.contextmanager
    def guard(self, aborts: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """End the span if the block raises (on success the generation ends it); ``aborts``
        are the exceptions that mean the client went away."""
        try:
            yield
        except BaseException as exc:
            self.fail(exc, aborted=isinstance(exc, aborts))
            raise

    def request(self, request: GenerationRequest) -> None:
        if self.recording:
            self.span.set_attributes({
                "tandem.request_id": request.request_id,
                "tandem.prompt_tokens": len(request.prompt_token_ids),
                "tandem.max_tokens": request.params.max_tokens})

    def client_request_id(self, request_id: str) -> None:
        """The id the client sent (gRPC), echoed back to it; the server's own id keys the
        request (``tandem.request_id``)."""
        if self.recording and request_id:
            self.span.set_attribute("tandem.client_request_id", request_id)

    def first_token(self) -> None:
        if self.recording:
            self.span.add_event("first_token")

    def finish(self, delta: Delta) -> None:
        self._finished = True
        if self.recording and delta.usage is not None:
            self.span.set_attributes({
                "tandem.finish_reason": delta.finish_reason or "",
                "tandem.completion_tokens": delta.usage.completion_tokens,
                "tandem.cached_tokens": delta.usage.cached_tokens})

    def fail(self, exc: BaseException, aborted: bool = False) -> None:
        """End the span: client errors and disconnects are outcomes, not failures of ours."""
        if self._ended:
            return
        if isinstance(exc, GatewayError) and exc.status < 500:
            self._finished = True  # rejected, not aborted
            if self.recording:
                self.span.set_attributes({"tandem.error.status": exc.status,
                                          "tandem.error.message": exc.message})
            self.end()
        elif aborted or isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.end()
        else:
            self._ended = True
            tracing.end_with_error(self.span, exc)

    def end(self) -> None:
        """End the span (once); a request that had not finished was aborted."""
        if self._ended:
            return
        self._ended = True
        if self.recording and not self._finished:
            self.span.set_attribute("tandem.finish_reason", "abort")
        self.span.end()
