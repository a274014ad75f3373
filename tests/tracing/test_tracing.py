"""tandem.services.tracing without a cluster: the on/off rule, the no-op path, W3C propagation
through dict carriers and the control RPC, exported to a real OTLP/gRPC receiver.

Each case runs in a fresh interpreter: OpenTelemetry's tracer provider is process-global and
can be set once, and this test session must stay untraced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.services.tracing import exporters_from_env
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60

pytestmark = pytest.mark.timeout(120)


def _run(script: str, env: dict[str, str]) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter with only ``env``'s OTEL_* variables; it prints
    one JSON line last."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                          env={**clean, **env}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    try:
        yield r
    finally:
        r.stop()


@pytest.mark.parametrize(("env", "want"), [
    ({}, ()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ("console", "otlp")),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, ()),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, ()),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, ()),
    ({"OTEL_SERVICE_NAME": "tandem"}, ()),
])
def test_which_environments_turn_tracing_on(env: dict[str, str], want: tuple[str, ...]) -> None:
    assert exporters_from_env(env) == want


def test_off_by_default_is_a_no_op() -> None:
    got = _run("""
        import json, sys
        from opentelemetry import trace
        from tandem.services import tracing
        from tandem.services.handoff.decode import DecodeTrace
        from tandem.services.gateway.core import RequestTrace
        from tandem.services.handoff.prefill import PrefillTrace

        parent = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
        on = tracing.configure("gateway")
        span = tracing.start_span("x")
        print(json.dumps({
            "on": on,
            "recording": [span.is_recording(), DecodeTrace("r", "w", 3).recording,
                          PrefillTrace("r", "w", 3).recording,
                          RequestTrace("http", "completions", parent).recording],
            "inject": tracing.inject(), "extract": tracing.extract(parent) is not None,
            "provider": type(trace.get_tracer_provider()).__name__,
            "sdk_loaded": [m for m in ("opentelemetry.sdk.trace",
                                       "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
                           if m in sys.modules],
        }))
    """, {})
    assert got == {"on": False, "recording": [False] * 4, "inject": None, "extract": False,
                   "provider": "ProxyTracerProvider", "sdk_loaded": []}


def _spans_named(spans: list[ReceivedSpan], *names: str) -> bool:
    return set(names) <= {s.name for s in spans}


def test_context_crosses_processes_in_a_dict(receiver: OtlpReceiver) -> None:
    """A carrier made in one process parents a span in another; both reach the receiver."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    parent = _run("""
        import json
        from opentelemetry import trace
        from tandem.services import tracing
        assert tracing.configure("gateway")
        span = tracing.start_span("parent")
        carrier = tracing.inject(trace.set_span_in_context(span))
        span.end()
        tracing.flush()
        ctx = span.get_span_context()
        print(json.dumps({"carrier": carrier, "trace_id": format(ctx.trace_id, "032x"),
                          "span_id": format(ctx.span_id, "016x")}))
    """, env)
    _run(f"""
        import json
        from tandem.services import tracing
        assert tracing.configure("prefill")
        with tracing.attached({parent["carrier"]!r}):
            tracing.start_span("child").end()
        tracing.flush()
        print("{{}}")
    """, env)
    spans = receiver.wait_for(lambda s: _spans_named(s, "parent", "child"), 30,
                              "the parent and child spans")
    by_name = {s.name: s for s in spans}
    child, root = by_name["child"], by_name["parent"]
    assert root.trace_id == child.trace_id == parent["trace_id"]
    assert root.parent_span_id == ""
    assert child.parent_span_id == parent["span_id"] == root.span_id
    assert (root.service, child.service) == ("tandem-gateway", "tandem-prefill")
    assert root.resource["tandem.role"] == "gateway"
    assert root.resource["process.pid"] != child.resource["process.pid"]


def test_control_rpc_carries_the_trace(receiver: OtlpReceiver) -> None:
    """A call made inside a span runs on the server in a ``control.<method>`` span under it;
    bad carriers off the wire are ignored, and OTEL_SERVICE_NAME names the service."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_SERVICE_NAME": "tandem-test"}
    got = _run("""
        import asyncio, json
        from opentelemetry import trace
        from tandem.services import tracing
        from tandem.loadtest.rpc_workers.rpc import RpcClient, RpcServer

        async def echo(params):
            return format(trace.get_current_span().get_span_context().trace_id, "032x")

        async def main():
            server = RpcServer({"echo": echo})
            await server.start()
            client = RpcClient("127.0.0.1", server.port)
            untraced = await client.call("echo")
            with tracing.tracer().start_as_current_span("caller") as span:
                traced = await client.call("echo")
            await client.close()
            await server.close()
            return untraced, traced, format(span.get_span_context().trace_id, "032x")

        assert tracing.configure("decode")
        untraced, traced, caller = asyncio.run(main())
        bad = [tracing.extract(c) is None for c in (
            {"traceparent": 5}, {"traceparent": "00-zz-yy-01"}, ["traceparent"],
            {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}, None)]
        tracing.flush()
        print(json.dumps({"untraced": untraced, "traced": traced, "caller": caller,
                          "bad_ignored": bad}))
    """, env)
    assert got["untraced"] == "0" * 32  # no trace: the handler ran outside any span
    assert got["traced"] == got["caller"]
    assert got["bad_ignored"] == [True] * 5
    spans = receiver.wait_for(lambda s: _spans_named(s, "caller", "control.echo"), 30,
                              "the caller and control.echo spans")
    by_name = {s.name: s for s in spans}
    assert by_name["control.echo"].parent_span_id == by_name["caller"].span_id
    assert by_name["control.echo"].kind == 2  # SERVER
    assert {s.service for s in spans} == {"tandem-test"}
    assert [s.name for s in spans].count("control.echo") == 1


def test_the_engine_knows_nothing_of_tracing() -> None:
    """Timings come from the worker layer; the engine package imports no OpenTelemetry."""
    engine = REPO / "services" / "engine"
    offenders = [path.name for path in sorted(engine.glob("*.py"))
                 if "opentelemetry" in path.read_text()
                 or "tandem.services.tracing" in path.read_text()
                 or "from tandem.services import tracing" in path.read_text()]
    assert offenders == []
