"""The gRPC front end: ``tandem.v1.Generation/Generate`` plus health checking and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.services.gateway.core import (
    CHAT_ROLES,
    MAX_CHOICES,
    Choices,
    Gateway,
    RequestTrace,
    SamplingOptions,
    check_token_ids,
    new_request_id,
    start_choices,
    template_message,
    text_chars,
    tokenize_chat,
    tokenize_prompt,
)
from tandem.services.gateway.errors import GatewayError, bad_request
from tandem.services.gateway.pb import generation_pb2 as pb
from tandem.services.gateway.pb import generation_pb2_grpc as pb_grpc
from tandem.services.gateway.pipeline import Delta
from tandem.services.gateway.replies import ReplyReader
from tandem.services.gateway.tools import Function, ToolCall, assistant_calls_text, with_tools
from tandem.services.gateway.tools import constraint as tool_constraint
from tandem.services.protocol.request import StructuredOutput
from tandem.services.tls import ServerTLS
from tandem.services.version import version

MAX_CLIENT_REQUEST_ID = 128  # characters of a client's request_id, echoed back
log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # tandem.v1.Generation
_OPERATION = "Generate"  # in logs

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def status_code(error: GatewayError) -> grpc.StatusCode:
    return _STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def refusal_trailers(error: GatewayError) -> Sequence[tuple[str, str | bytes]]:
    """When to try again, for each kind of client: ``retry-after`` (seconds, as HTTP's),
    ``grpc-retry-pushback-ms`` (what gRPC's retry policies read) and a ``google.rpc.RetryInfo``
    in the status details (``grpc-status-details-bin``, what Google's client libraries read).
    None without a retry hint."""
    if error.retry_after_s is None:
        return ()
    delay = Duration(seconds=error.retry_after_s)
    details = status_pb2.Status(code=status_code(error).value[0], message=error.message)
    details.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return (("retry-after", str(error.retry_after_s)),
            ("grpc-retry-pushback-ms", str(error.retry_after_s * 1000)),
            ("grpc-status-details-bin", details.SerializeToString()))


@dataclass
class GenerateStream:
    """A started ``Generate`` call: its choices' deltas, each written as a ``GenerateResponse``
    by ``response`` (with tools, its text is the reply's content and its last message carries
    the calls: ``replies.ReplyReader``)."""

    choices: Choices
    request_id: str  # what the responses echo: the client's, else the server's
    readers: list[ReplyReader] | None  # chat with tools: one per choice

    def response(self, index: int, delta: Delta) -> pb.GenerateResponse:
        if self.readers is None:
            return _response(self.request_id, delta, index, delta.text)
        reader = self.readers[index]
        piece = reader.read(delta)
        return _response(self.request_id, delta, index, piece.content,
                         reader.calls if piece.last is not None else ())


async def start_generation(gateway: Gateway, request: pb.GenerateRequest,
                           authorization: str | None = None,
                           metadata: Mapping[str, str] | None = None,
                           timeout_s: float | None = None) -> GenerateStream:
    """Start the call's choices (rejections raise ``GatewayError``). ``metadata`` may carry
    the caller's W3C ``traceparent``; ``timeout_s`` is what is left of the call's deadline (the
    request ends with DEADLINE_EXCEEDED when it passes)."""
    arrival = time.monotonic()
    trace = RequestTrace("grpc", "Generate", metadata)
    trace.client_request_id(request.request_id)
    with trace.guard():
        with gateway.refusals(_OPERATION, authorization):
            with trace.phase("gateway.parse"):
                tenant = gateway.caller(authorization)
                gateway.check_model(request.model)
                options = dataclasses.replace(_sampling_options(request),
                                              timeout_s=None if timeout_s is None
                                              else max(timeout_s, 1e-3))
                functions, mode = (_chat_tools(request.chat) if request.HasField("chat")
                                   else ([], None))
                forced = tool_constraint(functions, mode) if functions else None
                if forced is not None:
                    if options.structured_output is not None:
                        raise bad_request("chat.tool_choice and the sampling's structured output "
                                          "both constrain the output; give one",
                                          param="chat.tool_choice")
                    options = dataclasses.replace(options, structured_output=forced)
                if options.structured_output is not None:
                    await gateway.check_structured_output(
                        ("chat.tool_choice" if forced is not None
                         else request.sampling.WhichOneof("structured_output")
                         or "structured_output", options.structured_output))
                elif mode == "auto":  # the calls held to the tools' schemas
                    options = dataclasses.replace(
                        options, structured_output=await gateway.auto_tool_constraint(
                            functions, _parallel(request.chat)))
            with trace.phase("gateway.tokenize") as span:
                prompt = await _prompt_token_ids(gateway, request)
                span.set_attribute("tandem.prompt_tokens", len(prompt))
            if len(request.request_id) > MAX_CLIENT_REQUEST_ID:
                raise bad_request(f"request_id is longer than {MAX_CLIENT_REQUEST_ID} "
                                  "characters", param="request_id")
            # The server's own id keys the request everywhere; the client's is only echoed
            # back, so two calls with one id cannot meet in an engine, a lease or the router.
            greq = gateway.build_request(new_request_id("gen"), prompt, options,
                                         request.cache_salt or None, arrival,
                                         prompt_param=request.WhichOneof("input") or "prompt",
                                         tenant=tenant)
            n = request.n or 1
            if n > MAX_CHOICES:
                raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")
        keep = gateway.tool_tag_ids if mode == "auto" else frozenset()
        choices = await start_choices(gateway, greq, n, trace, keep)
    readers = None if mode is None else [
        ReplyReader(functions, mode, None, gateway.tool_parser, _parallel(request.chat))
        for _ in range(n)]
    return GenerateStream(choices, request.request_id or greq.request_id, readers)


class GenerationServicer(pb_grpc.GenerationServicer):
    """Writes each delta as it comes; a write waits while the call's HTTP/2 window and write
    buffer are full, so a client that stops reading stops the stream. One that has read
    nothing for ``client_read_timeout_s`` is cut (request aborted and counted, the call ended
    with CANCELLED), as over HTTP (http_app.py)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(self, request: pb.GenerateRequest | MalformedRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> None:
        metadata = {key: _as_str(value) or "" for key, value in
                    context.invocation_metadata() or () if not key.endswith("-bin")}
        if isinstance(request, MalformedRequest):
            error = bad_request(f"the request is not a valid GenerateRequest: {request.reason}")
            self.gateway.refused(_OPERATION, error, metadata.get("authorization"))
            await context.abort(status_code(error), error.message)
            return
        read_timeout_s = self.gateway.config.client_read_timeout_s
        try:
            stream = await start_generation(
                self.gateway, request, metadata.get("authorization"), metadata,
                context.time_remaining())
            choices = stream.choices
            try:
                async for index, delta in choices:
                    try:
                        async with asyncio.timeout(read_timeout_s):
                            await context.write(stream.response(index, delta))
                    except TimeoutError:
                        assert read_timeout_s is not None
                        await choices.cut_slow_client(read_timeout_s)
                        await context.abort(grpc.StatusCode.CANCELLED,
                                            f"the client read nothing for {read_timeout_s:g} s")
            finally:
                await choices.aclose()
        except GatewayError as exc:
            await context.abort(status_code(exc), exc.message,
                                trailing_metadata=refusal_trailers(exc))
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):  # context.abort's own exception
                raise
            log.exception("Generate failed", exc_info=exc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")


    async def GetModelInfo(self, request: pb.ModelInfoRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        metadata = dict(context.invocation_metadata() or ())
        try:
            self.gateway.authenticate(_as_str(metadata.get("authorization")))
        except GatewayError as exc:
            await context.abort(status_code(exc), exc.message)
        gateway = self.gateway
        return pb.ModelInfo(model=gateway.model_name, max_model_len=gateway.max_model_len,
                            vocab_size=gateway.tokenizer.vocab_size, server_version=version())


    async def Tokenize(self, request: pb.TokenizeRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        metadata = dict(context.invocation_metadata() or ())
        gateway = self.gateway
        try:
            gateway.authenticate(_as_str(metadata.get("authorization")))
            gateway.check_model(request.model or None)
            ids = await _prompt_token_ids(gateway, request)
        except GatewayError as exc:
            await context.abort(status_code(exc), exc.message)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=gateway.max_model_len)


HEALTH_REFRESH_S = 1.0  # how often gRPC health follows the gateway's health


@dataclass
class GrpcFrontEnd:
    """A grpc.aio server with Generation, health checking and reflection. Health says
    SERVING while the gateway can serve (``Gateway.health_problem``), else NOT_SERVING."""

    server: grpc.aio.Server
    port: int  # the bound port (the address may ask for port 0)
    health: health.aio.HealthServicer
    gateway: Gateway
    _watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.server.start()
        await self._refresh()
        self._watch = asyncio.create_task(self._follow(), name="tandem-grpc-health")

    async def stop(self, grace_s: float | None = 5.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.health.enter_graceful_shutdown()  # NOT_SERVING while calls drain
        await self.server.stop(grace_s)

    async def _refresh(self) -> None:
        serving = self.gateway.health_problem() is None
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_REFRESH_S)
            await self._refresh()


# Keepalive: clients may ping every 5 s or more, with or without a call in flight (gRPC's
# default server policy allows one ping per 5 minutes and answers more with GOAWAY
# too_many_pings; Go and Java clients commonly ping every 10-30 s through idle load balancers).
# The server pings an idle connection each minute and drops it if no answer comes in 20 s.
KEEPALIVE_OPTIONS = (("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                     ("grpc.keepalive_time_ms", 60_000),
                     ("grpc.keepalive_timeout_ms", 20_000))


def create_grpc_server(gateway: Gateway, address: str = "127.0.0.1:50051",
                       tls: ServerTLS | None = None) -> GrpcFrontEnd:
    """Build (not start) the gRPC front end; messages over the body limit get RESOURCE_EXHAUSTED.
    With ``tls`` the port serves TLS only."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", gateway.config.max_body_bytes),
                 *KEEPALIVE_OPTIONS],
        maximum_concurrent_rpcs=gateway.config.max_grpc_streams)
    _add_generation_servicer(GenerationServicer(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, grpc.ssl_server_credentials(
            [(tls.private_key, tls.cert_chain)]))
    return GrpcFrontEnd(server, port, health_servicer, gateway)


@dataclass(frozen=True)
class MalformedRequest:
    """Bytes that do not parse as a GenerateRequest (corrupt wire format, a string field that is
    not UTF-8): ``Generate`` answers INVALID_ARGUMENT, where grpc would say UNKNOWN."""

    reason: str


def _parse_request(data: bytes) -> pb.GenerateRequest | MalformedRequest:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return MalformedRequest(str(exc))


def _add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """``pb_grpc.add_GenerationServicer_to_server`` with a request parser that does not raise."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_parse_request,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.ModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize, request_deserializer=pb.TokenizeRequest.FromString,
            response_serializer=pb.TokenizeResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _as_str(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


async def _prompt_token_ids(gateway: Gateway, request: pb.GenerateRequest | pb.TokenizeRequest
                            ) -> list[int]:
    which = request.WhichOneof("input")
    if which == "prompt":
        return await gateway.tokenize("prompt", len(request.prompt), partial(
            tokenize_prompt, gateway.tokenizer, request.prompt))
    if which == "chat":
        bad = next((m.role for m in request.chat.messages if m.role not in CHAT_ROLES), None)
        if bad is not None:
            raise bad_request(f"unknown chat role {bad!r}", param="chat")
        messages = [template_message(m.role, _with_calls(m)) for m in request.chat.messages]
        functions, _ = _chat_tools(request.chat)
        own = gateway.tokenizer.template_renders_tools
        rendered = with_tools(messages, functions, own) if functions else messages
        specs = [f.spec() for f in functions] if own and functions else None
        return await gateway.tokenize("chat", text_chars(messages), partial(
            tokenize_chat, gateway.tokenizer, rendered, specs))
    if which == "token_ids":
        assert isinstance(request, pb.GenerateRequest)
        return check_token_ids(request.token_ids.ids, gateway.tokenizer.vocab_size,
                               param="token_ids")
    raise bad_request("set one of prompt, chat or token_ids"
                      if isinstance(request, pb.GenerateRequest)
                      else "set one of prompt or chat", param="input")


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI's (openai_protocol.FunctionDef)
MAX_TOOLS = 128


def _chat_tools(chat: pb.ChatMessages) -> tuple[list[Function], str | None]:
    """The chat's tools, and its tool_choice (None: no tools); 400 naming the field."""
    if len(chat.tools) > MAX_TOOLS:
        raise bad_request(f"chat.tools: at most {MAX_TOOLS} tools", param="chat.tools")
    functions = []
    for i, tool in enumerate(chat.tools):
        if not _TOOL_NAME.fullmatch(tool.name):
            raise bad_request(f"chat.tools[{i}].name: 1 to 64 letters, digits, _ or -",
                              param=f"chat.tools[{i}].name")
        schema = None
        if tool.parameters_json:
            try:
                schema = json.loads(tool.parameters_json)
            except json.JSONDecodeError as exc:
                raise bad_request(f"chat.tools[{i}].parameters_json is not JSON: {exc}",
                                  param=f"chat.tools[{i}].parameters_json") from None
            if not isinstance(schema, dict):
                raise bad_request(f"chat.tools[{i}].parameters_json must be a JSON schema object",
                                  param=f"chat.tools[{i}].parameters_json")
        functions.append(Function(tool.name, tool.description or None, schema))
    choice = chat.tool_choice or "auto"
    if not functions:
        if choice not in ("none", "auto"):
            raise bad_request("chat.tool_choice needs tools", param="chat.tool_choice")
        return [], None
    if choice not in ("none", "auto", "required") and choice not in {f.name for f in functions}:
        raise bad_request(f"chat.tool_choice names {choice!r}, which is not among the tools",
                          param="chat.tool_choice")
    return functions, choice


def _with_calls(message: pb.ChatMessage) -> str:
    """A message's text, with an assistant's earlier calls as the model would have written them."""
    if not message.tool_calls:
        return message.content
    calls = assistant_calls_text([{"function": {"name": c.name, "arguments": c.arguments}}
                                  for c in message.tool_calls])
    return f"{message.content}\n{calls}" if message.content else calls


def _sampling_options(request: pb.GenerateRequest) -> SamplingOptions:
    s = request.sampling
    return SamplingOptions(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        speculative=s.speculative if s.HasField("speculative") else True,
        num_speculative_tokens=(s.num_speculative_tokens if s.HasField("num_speculative_tokens")
                                else None),
        stop_token_ids=tuple(s.stop_token_ids),
        min_tokens=s.min_tokens if s.HasField("min_tokens") else None,
        logit_bias=dict(s.logit_bias) or None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty")
                            else None),
        min_p=s.min_p if s.HasField("min_p") else None,
        structured_output=_structured_output(s),
    )


def _structured_output(s: pb.SamplingOptions) -> StructuredOutput | None:
    try:
        return _constraint_of(s)
    except ValueError as exc:  # StructuredOutput's own checks (the spec's size)
        raise bad_request(str(exc), param="structured_output") from None


def _constraint_of(s: pb.SamplingOptions) -> StructuredOutput | None:
    which = s.WhichOneof("structured_output")
    if which is None or (which == "json_object" and not s.json_object):
        return None
    if which == "json_object":
        return StructuredOutput("json", '{"type": "object"}')
    if which == "json_schema":
        return StructuredOutput("json", s.json_schema)
    if which == "choice":
        if not s.choice.choices or not all(s.choice.choices):
            raise bad_request("choice needs non-empty strings", param="choice")
        return StructuredOutput("choice", json.dumps(list(s.choice.choices)))
    return StructuredOutput(which, getattr(s, which))


def _parallel(chat: pb.ChatMessages) -> bool:
    """``parallel_tool_calls`` (unset: true)."""
    return not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls


def _response(request_id: str, delta: Delta, index: int, text: str,
              calls: Sequence[ToolCall] = ()) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=request_id,
        index=index,
        token_ids=delta.token_ids,
        text=text,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls],
        logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
                  for lp in delta.logprobs],
    )
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS.get(delta.finish_reason,
                                                     pb.FINISH_REASON_UNSPECIFIED)
    if delta.usage is not None:
        response.usage.CopyFrom(pb.Usage(prompt_tokens=delta.usage.prompt_tokens,
                                         completion_tokens=delta.usage.completion_tokens,
                                         cached_tokens=delta.usage.cached_tokens))
    return response
