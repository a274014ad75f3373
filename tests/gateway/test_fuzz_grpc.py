"""Property-based fuzzing of gRPC Generate: random GenerateRequests (NaN, Infinity, huge and out
of range numbers, empty and huge strings, unknown roles and models, out-of-vocabulary token ids)
against a real grpc.aio server over the real gateway and engine. Every call ends OK or with a
client-error status (never INTERNAL or UNKNOWN), and afterwards the server still serves.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.conftest import MAX_MODEL_LEN
from tests.gateway.helpers import FUZZ_MAX_TOKENS, wait_engine_idle

MAX_TOKENS = FUZZ_MAX_TOKENS
MAX_EXAMPLES = 120
UINT32 = 2**32 - 1
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
HUGE = 1100 * 1024  # over the 1 MiB message limit



@pytest.fixture(scope="module")
def stub(fuzz_server: ServeAddresses) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(fuzz_server.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


# Protobuf strings are UTF-8: any code point but a lone surrogate.
_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
strings = st.one_of(_text, st.sampled_from(["", " ", "\x00", "Hello", "x" * 5000,
                                            "\U0001f600" * 300, "<|im_start|>", "{{ x }}"]))
floats = st.one_of(
    st.floats(width=32),  # NaN, +-Infinity, subnormals, +-0 and everything between
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 1e-30, 1e-6,
                     1e-5, 0.5, 1.0, 2.0, 2.0000002, 3.4e38, -1.0]))
uint32s = st.one_of(st.integers(0, 24), st.integers(0, UINT32), st.sampled_from([UINT32, 2**31]))
int64s = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1]))
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool", "",
                                   "USER", "function"]), _text)


def _maybe(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(st.none(), strategy)


# Values near the valid ranges, at and just past their bounds.
_near = {
    "max_tokens": st.integers(0, MAX_TOKENS + 1),
    "temperature": st.one_of(st.floats(0.0, 2.0, width=32), floats),
    "top_p": st.one_of(st.floats(0.0, 1.0, width=32), st.sampled_from([1e-45, 1e-38])),
    "top_k": st.one_of(st.integers(0, 50), uint32s),
    "seed": int64s,
    "logprobs": st.integers(0, 21),
    "speculative": st.booleans(),
    "num_speculative_tokens": st.integers(0, 17),
}
_wild = {"max_tokens": uint32s, "temperature": floats, "top_p": floats, "top_k": uint32s,
         "seed": int64s, "logprobs": uint32s, "speculative": st.booleans(),
         "num_speculative_tokens": uint32s}


@st.composite
def sampling_options(draw: st.DrawFn, near: bool) -> pb.SamplingOptions:
    s = pb.SamplingOptions(stop=draw(st.lists(strings, max_size=3 if near else 20)),
                           ignore_eos=draw(st.booleans()))
    for name, values in (_near if near else _wild).items():
        value = draw(_maybe(values))
        if value is not None:
            setattr(s, name, value)
    # Valid lengths are folded into 1..MAX_TOKENS; 0 and lengths past the context stay.
    if s.HasField("max_tokens") and MAX_TOKENS < s.max_tokens <= MAX_MODEL_LEN:
        s.max_tokens = s.max_tokens % MAX_TOKENS + 1
    return s


@st.composite
def generate_requests(draw: st.DrawFn, model_name: str, vocab_size: int) -> pb.GenerateRequest:
    """Half the requests are wild in every field; the other half have a valid model and input,
    and sampling options near (and just past) their bounds, so that many reach the engine."""
    if draw(st.booleans()):
        return draw(_wild_requests(model_name))
    request = pb.GenerateRequest(model=draw(st.sampled_from(["", model_name])),
                                 cache_salt=draw(strings),
                                 sampling=draw(sampling_options(near=True)))
    which = draw(st.sampled_from(["prompt", "chat", "token_ids"]))
    if which == "prompt":
        request.prompt = draw(_text.filter(bool))
    elif which == "chat":
        messages = draw(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                                           _text), min_size=1, max_size=3))
        request.chat.CopyFrom(pb.ChatMessages(
            messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))
    else:
        ids = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=30))
        request.token_ids.CopyFrom(pb.TokenIds(ids=ids))
    return request


@st.composite
def _wild_requests(draw: st.DrawFn, model_name: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        model=draw(st.one_of(st.sampled_from(["", model_name]), strings)),
        cache_salt=draw(strings),
        request_id=draw(st.one_of(st.just(""), _text, st.just("r" * 129))))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_options(near=False)))
    which = draw(st.sampled_from(["prompt", "chat", "token_ids", None]))
    if which == "prompt":
        request.prompt = draw(st.one_of(strings, st.just("a" * HUGE)))
    elif which == "chat":
        messages = draw(st.lists(st.tuples(roles, strings), max_size=4))
        request.chat.CopyFrom(pb.ChatMessages(
            messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))
    elif which == "token_ids":
        ids = draw(st.lists(st.one_of(st.integers(0, 49151), uint32s), max_size=30))
        request.token_ids.CopyFrom(pb.TokenIds(ids=ids))
    return request


def _call(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest
          ) -> tuple[grpc.StatusCode, list[pb.GenerateResponse], str]:
    responses: list[pb.GenerateResponse] = []
    try:
        for response in stub.Generate(request, timeout=60):
            responses.append(response)
    except grpc.RpcError as exc:
        return exc.code(), responses, exc.details() or ""
    return grpc.StatusCode.OK, responses, ""


@pytest.mark.timeout(300)
def test_fuzz_generate(stub: pb_grpc.GenerationStub, gateway: Gateway) -> None:
    seen: set[grpc.StatusCode] = set()

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=30_000, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(request=generate_requests(gateway.model_name, gateway.tokenizer.vocab_size))
    def fuzz(request: pb.GenerateRequest) -> None:
        code, responses, details = _call(stub, request)
        seen.add(code)
        assert code in ALLOWED, (code, details)
        if code != grpc.StatusCode.OK:
            assert details, code  # every rejection says why
            return
        last = responses[-1]
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert 1 <= last.usage.completion_tokens <= (request.sampling.max_tokens or MAX_TOKENS)
        assert sum(len(r.token_ids) for r in responses) == last.usage.completion_tokens

    fuzz()
    # The generated calls reached the engine as well as its checks.
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen, seen


@st.composite
def wire_messages(draw: st.DrawFn, model_name: str, vocab_size: int) -> bytes:
    """What arrives on the wire: random bytes, valid requests with bytes flipped or cut, and
    strings that are not UTF-8."""
    data = draw(st.one_of(
        st.binary(max_size=200),
        st.sampled_from([b"\xff\xff\xff", b"\x0a\x02\xc3\x28", b"\x12\x02\xed\xa0",
                         b"\x0a\x80\x80\x80\x80\x10", b"\x2a\x03\x08\xff\xff"]),
        generate_requests(model_name, vocab_size).flatmap(lambda r: _corrupted(
            r.SerializeToString()))))
    try:
        request = pb.GenerateRequest.FromString(data)
    except DecodeError:
        return data
    if MAX_TOKENS < request.sampling.max_tokens <= MAX_MODEL_LEN:  # keep it short, as above
        request.sampling.max_tokens = request.sampling.max_tokens % MAX_TOKENS + 1
        return request.SerializeToString()
    return data


def _corrupted(data: bytes) -> st.SearchStrategy[bytes]:
    if not data:
        return st.just(data)
    flip = st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)).map(
        lambda f: data[:f[0]] + bytes([data[f[0]] ^ f[1]]) + data[f[0] + 1:])
    cut = st.integers(0, len(data) - 1).map(lambda n: data[:n])
    return st.one_of(flip, cut)


@pytest.mark.timeout(300)
def test_fuzz_generate_wire(fuzz_server: ServeAddresses, gateway: Gateway) -> None:
    """Bytes that are not a GenerateRequest are INVALID_ARGUMENT, not grpc's UNKNOWN."""
    seen: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(fuzz_server.grpc_target) as channel:
        generate = channel.unary_stream("/tandem.v1.Generation/Generate")  # raw bytes both ways

        @settings(max_examples=MAX_EXAMPLES // 2, derandomize=True, deadline=30_000,
                  database=None, suppress_health_check=list(HealthCheck), print_blob=True)
        @given(data=wire_messages(gateway.model_name, gateway.tokenizer.vocab_size))
        def fuzz(data: bytes) -> None:
            try:
                for _ in generate(data, timeout=60):
                    pass
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
            seen.add(code)
            assert code in ALLOWED, (code, details)

        fuzz()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen, seen


def test_bytes_that_are_not_a_request_are_invalid_argument(fuzz_server: ServeAddresses
                                                            ) -> None:
    """grpc answered UNKNOWN, naming protobuf's DecodeError, before ``_parse_request``."""
    with grpc.insecure_channel(fuzz_server.grpc_target) as channel:
        generate = channel.unary_stream("/tandem.v1.Generation/Generate")
        for data in (b"\xff\xff\xff", b"\x0a\x02\xc3\x28"):  # corrupt; a model not UTF-8
            with pytest.raises(grpc.RpcError) as failure:
                list(generate(data, timeout=60))
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid GenerateRequest" in (failure.value.details() or "")


def test_serves_after_fuzzing(stub: pb_grpc.GenerationStub, async_engine: AsyncEngine) -> None:
    wait_engine_idle(async_engine)
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")]),
        sampling=pb.SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True))
    code, responses, details = _call(stub, request)
    assert code == grpc.StatusCode.OK, details
    assert responses[-1].usage.completion_tokens == 2
