"""One trace per request across a real `tandem up` cluster (1 prefill + 1 decode), exported
over OTLP/gRPC to an in-test receiver: span tree, parents, processes and key attributes, for
requests over HTTP (the official openai client) and gRPC, with and without a client
``traceparent``."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from openai import NotFoundError, OpenAI

from tandem.router import decision as reasons
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tests.e2e.cluster import UpProcess
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

MODEL = "SmolLM2-135M-Instruct"
CHUNK_TOKENS = 32  # the prefill chunk (per-step token budget): prompts below span several
BLOCK_SIZE = 16
MAX_TOKENS = 6
SERVER = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
FLUSH_TIMEOUT_S = 60

# span -> (its parent, the process role that records it)
TREE = {
    "gateway.request": (None, "gateway"),
    "gateway.parse": ("gateway.request", "gateway"),
    "gateway.tokenize": ("gateway.request", "gateway"),
    "router.decision": ("gateway.request", "gateway"),
    "prefill": ("gateway.request", "prefill"),
    "prefill.queue": ("prefill", "prefill"),
    "prefill.chunks": ("prefill", "prefill"),
    "decode": ("gateway.request", "decode"),
    "kv_transfer": ("decode", "decode"),
    "control.release": ("kv_transfer", "prefill"),  # D confirms the lease on P (a Serve call)
    "decode.queue": ("decode", "decode"),
    "decode.steps": ("decode", "decode"),
}
ROUTER_REASONS = {reasons.PREFIX, reasons.LOAD, reasons.FALLBACK, reasons.ROUND_ROBIN}

pytestmark = pytest.mark.timeout(600)


def _text(topic: str) -> str:
    return (f"Here are some careful notes about {topic}, written for a student who wants to "
            "understand the subject well. Each paragraph builds on the one before it and ends "
            "with a question to think about. Read them slowly and summarise the main idea of "
            f"each paragraph in one sentence. The first paragraph is about the history of {topic}.")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def traced_cluster(receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[UpProcess]:
    """The cluster inherits the OTLP settings from `tandem up`'s environment, as an operator
    sets them; Ray's worker processes must see them too."""
    log = Path(tmp_path_factory.mktemp("up-traced")) / "tandem-up.log"
    with pytest.MonkeyPatch.context() as env:
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME",
                     "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER"):
            env.delenv(name, raising=False)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: spans reach the receiver quickly
        up = UpProcess(["--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
                        "--max-num-batched-tokens", str(CHUNK_TOKENS)], log).start()
    try:
        yield up
    finally:
        up.stop()


def _client_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _request_trace(receiver: OtlpReceiver, request_id: str) -> list[ReceivedSpan]:
    """The spans of the trace whose gateway span served ``request_id``, once all have come."""

    def trace_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        roots = [s for s in spans if s.name == "gateway.request"
                 and s.attributes.get("tandem.request_id") == request_id]
        return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

    spans = receiver.wait_for(lambda s: set(TREE) <= {x.name for x in trace_of(s)},
                              FLUSH_TIMEOUT_S, f"the spans of request {request_id}")
    return trace_of(spans)


def _check_trace(spans: list[ReceivedSpan], all_spans: list[ReceivedSpan], request_id: str,
                 prompt_tokens: int, completion_tokens: int,
                 client: tuple[str, str] | None = None) -> None:
    """``client``: the (trace id, span id) the client sent as its traceparent, if any."""
    names = [s.name for s in spans]
    for name in TREE:
        assert names.count(name) == 1, f"{name} appears {names.count(name)} times: {names}"
    by_name = {s.name: s for s in spans}
    root = by_name["gateway.request"]

    # One trace per request: every span naming this request is in it.
    assert {s.trace_id for s in all_spans
            if s.attributes.get("tandem.request_id") == request_id} == {root.trace_id}
    if client is None:
        assert root.parent_span_id == ""
    else:
        assert (root.trace_id, root.parent_span_id) == client
    assert root.kind == SERVER

    for name, (parent, role) in TREE.items():
        span = by_name[name]
        if parent is not None:
            assert span.parent_span_id == by_name[parent].span_id, f"{name}'s parent"
        assert span.service == f"tandem-{role}", f"{name} comes from {span.service}"
        assert span.resource["tandem.role"] == role
        assert span.status_code != 2, f"{name} failed: {span}"
    assert len({s.resource["process.pid"] for s in spans}) >= 3
    for child in ("prefill", "decode"):  # one clock: the workers' spans lie inside the request
        assert root.start_ns <= by_name[child].start_ns <= by_name[child].end_ns <= root.end_ns
    assert by_name["prefill"].end_ns <= by_name["decode"].start_ns

    attrs = {name: span.attributes for name, span in by_name.items()}
    assert attrs["gateway.request"]["tandem.request_id"] == request_id
    assert attrs["gateway.request"]["tandem.prompt_tokens"] == prompt_tokens
    assert attrs["gateway.request"]["tandem.completion_tokens"] == completion_tokens
    assert "first_token" in root.event_names()
    assert attrs["gateway.tokenize"]["tandem.prompt_tokens"] == prompt_tokens

    router = attrs["router.decision"]
    assert router["tandem.request_id"] == request_id
    assert router["tandem.router.reason"] in ROUTER_REASONS
    assert router["tandem.router.prefill_worker"] == attrs["prefill"]["tandem.worker_id"]
    assert router["tandem.router.decode_worker"] == attrs["decode"]["tandem.worker_id"]
    assert router["tandem.router.prefill_candidates"] == [router["tandem.router.prefill_worker"]]
    assert len(router["tandem.router.prefill_scores"]) == 1
    assert router["tandem.router.prompt_blocks"] == -(-prompt_tokens // BLOCK_SIZE)

    prefill = attrs["prefill"]
    assert prefill["tandem.request_id"] == request_id
    assert prefill["tandem.prompt_tokens"] == prompt_tokens
    computed = prompt_tokens - prefill["tandem.cached_tokens"]
    chunks = attrs["prefill.chunks"]
    assert chunks["tandem.prefill.computed_tokens"] == computed
    assert chunks["tandem.prefill.chunks"] == -(-computed // CHUNK_TOKENS)
    assert "first_token" in by_name["prefill"].event_names()

    kv = attrs["kv_transfer"]
    blocks = -(-prompt_tokens // BLOCK_SIZE)
    assert kv["tandem.kv.transport"] == "tcp"
    assert kv["tandem.kv.blocks"] == blocks
    assert kv["tandem.kv.blocks_pulled"] + kv["tandem.kv.blocks_reused"] == blocks
    assert kv["tandem.kv.blocks_pulled"] > 0 and kv["tandem.kv.bytes"] > 0
    assert kv["tandem.kv.source_worker"] == attrs["prefill"]["tandem.worker_id"]
    assert by_name["kv_transfer"].event_names() == ["blocks_read", "lease_released"]

    decode = by_name["decode"]
    assert decode.attributes["tandem.kv.source"] == "transfer"
    finish = [e for e in decode.events if e.name == "finish"]
    assert len(finish) == 1
    assert finish[0].attributes["tandem.output_tokens"] == completion_tokens
    steps = by_name["decode.steps"]
    # The first token came from the prefill worker; the decode worker made the rest.
    assert steps.attributes["tandem.decode.tokens"] == completion_tokens - 1
    assert steps.event_names() == ["step"] * steps.attributes["tandem.decode.outputs"]


def test_http_request_is_one_trace(traced_cluster: UpProcess, receiver: OtlpReceiver) -> None:
    client = OpenAI(base_url=f"{traced_cluster.http_url}/v1", api_key="unused", max_retries=0,
                    timeout=120)
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _text("rivers")}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert response.usage is not None
    assert response.usage.prompt_tokens > 2 * CHUNK_TOKENS
    spans = _request_trace(receiver, response.id)
    _check_trace(spans, receiver.spans(), response.id, response.usage.prompt_tokens,
                 response.usage.completion_tokens)
    root = next(s for s in spans if s.name == "gateway.request")
    assert root.attributes["tandem.entry"] == "http"
    assert root.attributes["tandem.operation"] == "chat.completions"
    assert root.attributes["tandem.finish_reason"] == "length"


def test_http_stream_honours_client_traceparent(traced_cluster: UpProcess,
                                                receiver: OtlpReceiver) -> None:
    traceparent, trace_id, span_id = _client_traceparent()
    client = OpenAI(base_url=f"{traced_cluster.http_url}/v1", api_key="unused", max_retries=0,
                    timeout=120)
    stream = client.completions.create(
        model=MODEL, prompt=_text("glaciers"), max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": traceparent})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    spans = _request_trace(receiver, chunks[0].id)
    _check_trace(spans, receiver.spans(), chunks[0].id, usage.prompt_tokens,
                 usage.completion_tokens, client=(trace_id, span_id))


def test_grpc_request_honours_client_traceparent(traced_cluster: UpProcess,
                                                 receiver: OtlpReceiver) -> None:
    traceparent, trace_id, span_id = _client_traceparent()
    request_id = f"grpc-{secrets.token_hex(4)}"
    with grpc.insecure_channel(traced_cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            request_id=request_id, prompt=_text("volcanoes"),
            sampling=pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        responses = list(stub.Generate(request, timeout=120,
                                       metadata=(("traceparent", traceparent),)))
    usage = responses[-1].usage
    assert {r.request_id for r in responses} == {request_id}  # echoed, not used as a key
    received = receiver.wait_for(
        lambda s: any(x.name == "gateway.request"
                      and x.attributes.get("tandem.client_request_id") == request_id for x in s),
        FLUSH_TIMEOUT_S, f"the gateway span of {request_id}")
    root = next(x for x in received
                if x.attributes.get("tandem.client_request_id") == request_id)
    server_id = str(root.attributes["tandem.request_id"])
    assert server_id != request_id
    spans = _request_trace(receiver, server_id)
    _check_trace(spans, receiver.spans(), server_id, usage.prompt_tokens,
                 usage.completion_tokens, client=(trace_id, span_id))
    assert root.attributes["tandem.entry"] == "grpc"


def test_rejected_request_is_a_short_trace(traced_cluster: UpProcess,
                                           receiver: OtlpReceiver) -> None:
    """A client error ends the request span with its status, not as a failure of Tandem's."""
    traceparent, trace_id, span_id = _client_traceparent()
    client = OpenAI(base_url=f"{traced_cluster.http_url}/v1", api_key="unused", max_retries=0,
                    timeout=60)
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[
            {"role": "user", "content": "hi"}], extra_headers={"traceparent": traceparent})
    spans = receiver.wait_for(
        lambda s: any(x.trace_id == trace_id and x.name == "gateway.request" for x in s),
        FLUSH_TIMEOUT_S, "the rejected request's span")
    mine = [s for s in spans if s.trace_id == trace_id]
    assert sorted(s.name for s in mine) == ["gateway.parse", "gateway.request"]
    root = next(s for s in mine if s.name == "gateway.request")
    assert root.parent_span_id == span_id
    assert root.attributes["tandem.error.status"] == 404
    assert root.status_code != 2 and all(s.status_code != 2 for s in mine)
