"""OpenTelemetry tracing: set-up from the standard ``OTEL_*`` variables, and W3C trace context
carried in plain dicts between Tandem's processes.

Tracing is on in a process when ``configure`` finds, with ``OTEL_SDK_DISABLED`` not ``true``:

* ``OTEL_TRACES_EXPORTER`` naming ``otlp`` and/or ``console`` (comma-separated), or
* ``OTEL_TRACES_EXPORTER`` unset and an OTLP endpoint set (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
  or ``OTEL_EXPORTER_OTLP_ENDPOINT``).

Anything else (nothing set, ``OTEL_TRACES_EXPORTER=none``) leaves OpenTelemetry's no-op tracer:
spans are non-recording, ``inject`` returns None and the SDK and exporters are never imported.
When on, the SDK reads the rest of the standard variables itself: the OTLP/gRPC exporter's
endpoint, headers, TLS and timeout, ``OTEL_TRACES_SAMPLER(_ARG)``, ``OTEL_BSP_*`` (batching),
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.

Context travels as ``{"traceparent": ..., "tracestate": ...}`` inside the requests already
passed between processes (Ray Serve handle calls, the JSON control RPC) and as gRPC metadata
or HTTP headers at the gateway. Callers check ``span.is_recording()`` before building attributes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACER_NAME = "tandem"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXPORTERS = ("otlp", "console")

Carrier = dict[str, str]

_propagator = TraceContextTextMapPropagator()
_lock = threading.Lock()
_provider: Any = None  # the SDK TracerProvider once configured (the SDK is imported lazily)
# A proxy until a provider is installed; then it delegates to that provider's tracer.
_tracer = trace.get_tracer(TRACER_NAME)


def exporters_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters the environment asks for; () means tracing stays off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not names:
        endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        return ("otlp",) if endpoint else ()
    wanted = tuple(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    unknown = [n for n in wanted if n not in (*EXPORTERS, "none")]
    if unknown:
        log.warning("OTEL_TRACES_EXPORTER: ignoring unsupported exporter(s) %s (Tandem ships %s)",
                    ", ".join(unknown), ", ".join(EXPORTERS))
    return tuple(n for n in wanted if n in EXPORTERS)


def configure(role: str) -> bool:
    """Install the SDK tracer provider for this process if the environment turns tracing on;
    returns whether tracing is on. Idempotent: the first call in a process decides.

    ``role`` (gateway, prefill, decode) becomes the ``tandem.role`` resource attribute and the
    default ``service.name`` (``tandem-<role>``) unless OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES name the service.
    """
    global _provider
    env = os.environ
    with _lock:
        if _provider is not None:
            return True
        exporters = exporters_from_env(env)
        if not exporters:
            return False
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        if "otlp" in exporters and protocol != "grpc":
            log.error("tracing stays off: OTLP protocol %r is not supported (Tandem exports "
                      "OTLP over gRPC; unset OTEL_EXPORTER_OTLP_PROTOCOL or set it to grpc)",
                      protocol)
            return False
        _provider = _install(role, exporters)
        log.info("tracing on: %s span export from the %s process", "+".join(exporters), role)
        return True


def _install(role: str, exporters: tuple[str, ...]) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"tandem.role": role, "process.pid": os.getpid()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"tandem-{role}"}))
    provider = TracerProvider(resource=resource)  # reads OTEL_TRACES_SAMPLER(_ARG)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter: Any = OTLPSpanExporter()  # endpoint, headers, TLS, timeout from OTEL_*
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* batching
    trace.set_tracer_provider(provider)
    return provider


def enabled() -> bool:
    return _provider is not None


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered (a process about to stop calls this)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def tracer() -> Tracer:
    return _tracer


def inject(context: Context | None = None) -> Carrier | None:
    """The W3C trace context of ``context``'s span (default: the current one) as a dict, or
    None when there is none to pass on (tracing off: nothing extra goes on the wire)."""
    if _provider is None:
        return None
    carrier: Carrier = {}
    _propagator.inject(carrier, context)
    return carrier or None


def extract(carrier: Mapping[str, Any] | None) -> Context | None:
    """The context a carrier (a dict off the wire, HTTP headers, gRPC metadata) names, or None.
    Only string ``traceparent``/``tracestate`` values are read; malformed ones are ignored."""
    if _provider is None or not isinstance(carrier, Mapping):
        return None
    fields = {key: value for key in (TRACEPARENT, TRACESTATE)
              if isinstance(value := carrier.get(key), str)}
    if TRACEPARENT not in fields:
        return None
    context = _propagator.extract(fields)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


@contextlib.contextmanager
def attached(carrier: Mapping[str, Any] | None) -> Iterator[None]:
    """Make a carrier's context the current one for the block (not across a ``yield`` of an
    async generator: the context may differ between its steps)."""
    context = extract(carrier)
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def served(name: str, carrier: Mapping[str, Any] | None) -> Iterator[None]:
    """Run a call from another process in a SERVER span ``name`` under the caller's carrier
    (nothing when the call carries no trace)."""
    context = extract(carrier)
    if context is None:
        yield
        return
    span = start_span(name, context, SpanKind.SERVER)
    with trace.use_span(span, end_on_exit=True):
        yield


def start_span(name: str, parent: Span | Context | None = None,
               kind: SpanKind = SpanKind.INTERNAL, start_ns: int | None = None) -> Span:
    """A span under ``parent`` (a span, a context, or None: the current context); the no-op
    span when tracing is off."""
    if _provider is None:
        return INVALID_SPAN
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return tracer().start_span(name, context=context, kind=kind, start_time=start_ns)


def record_span(parent: Span, name: str, start_ns: int, end_ns: int,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A finished child span from timestamps taken earlier (phases seen after the fact)."""
    if not parent.is_recording():
        return
    span = tracer().start_span(name, context=trace.set_span_in_context(parent),
                               start_time=start_ns, attributes=attributes)
    span.end(end_time=max(end_ns, start_ns))


def mark_failed(span: Span, exc: BaseException) -> None:
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def end_with_error(span: Span, exc: BaseException) -> None:
    """Mark the span failed with ``exc`` and end it."""
    mark_failed(span, exc)
    span.end()
