"""A real OTLP/gRPC trace receiver for tests: a grpc server on 127.0.0.1 implementing the
collector's ``TraceService/Export`` that keeps every span it is sent, flattened."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class Event:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # hex
    span_id: str  # hex
    parent_span_id: str  # hex; "" for a root
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: tuple[Event, ...] = field(default=())

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    def event_names(self) -> list[str]:
        return [e.name for e in self.events]


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return None if which is None else getattr(value, which)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class OtlpReceiver(pb_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait()

    def Export(self, request: pb.ExportTraceServiceRequest,  # noqa: N802 (the RPC's name)
               context: grpc.ServicerContext) -> pb.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), name=span.name,
                        kind=span.kind, start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano, status_code=span.status.code,
                        attributes=_attributes(span.attributes), resource=resource,
                        events=tuple(Event(e.name, e.time_unix_nano, _attributes(e.attributes))
                                     for e in span.events)))
        with self._changed:
            self._spans.extend(received)
            self._changed.notify_all()
        return pb.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, check: Callable[[list[ReceivedSpan]], bool], timeout_s: float,
                 what: str) -> list[ReceivedSpan]:
        """Block until ``check(all spans so far)`` holds (re-checked on every export)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not check(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; "
                                         f"{len(self._spans)} spans received: {names}")
                self._changed.wait(left)
            return list(self._spans)
