"""The OpenAI-compatible HTTP front end (FastAPI): completions, chat, models, health, metrics.

The gateway's HTTP plumbing around its routes: the SSE response of a streamed generation
(what happens to a client that stops reading), and the request body limit (below).

uvicorn's ``send`` waits while the connection's write buffer is above its high-water mark
(64 KiB), so a client that stops reading stops this response from pulling the next delta: what
is buffered for one stream is that buffer plus what the workers produce meanwhile. A client
that has read nothing for ``read_timeout_s`` is cut: its request is aborted on every worker
(blocks freed), counted (``tandem_request_failures_total{reason="slow_client"}``), logged once,
and its connection dropped by ``abort_connection`` (which the server that owns the socket
supplies; without one the response just ends and the server closes the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, MutableMapping
from functools import partial
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.services.gateway.core import (
    Choices,
    Gateway,
    LogSampler,
    RequestTrace,
    check_token_ids,
    cumulative_logprob,
    new_request_id,
    start_choices,
    text_chars,
    tokenize_chat,
    tokenize_prompt,
    total_usage,
)
from tandem.services.gateway.errors import (
    GatewayError,
    bad_request,
    body_too_large,
    unavailable,
)
from tandem.services.gateway.messages_api import (
    MessageEvents,
    MessagesError,
    MessagesRequest,
    content_blocks,
    message_json,
    new_message_id,
    stop_reason,
)
from tandem.services.gateway.messages_api import error_json as message_error_json
from tandem.services.gateway.messages_api import to_chat as to_messages_chat
from tandem.services.gateway.messages_api import usage_json as message_usage
from tandem.services.gateway.openai_protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ResponseContext,
    TokenizeRequest,
    sse,
    sse_event,
    template_messages,
)
from tandem.services.gateway.pipeline import Delta, Usage
from tandem.services.gateway.reasoning import split_reasoning, starts_in_reasoning
from tandem.services.gateway.replies import ReplyReader
from tandem.services.gateway.responses_api import (
    OutputIds,
    RedisResponseStore,
    Reply,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    StoreUnavailable,
    input_messages,
    new_id,
    output_items,
    response_json,
    to_chat,
    turns_of,
)
from tandem.services.gateway.token_text import TokenText
from tandem.services.gateway.tool_parsers import ToolParser
from tandem.services.gateway.tools import (
    CallDelta,
    ToolCall,
    parse_reply,
    with_tools,
)
from tandem.services.protocol.request import GenerationRequest
from tandem.services.version import version

log = logging.getLogger(__name__)

T = TypeVar("T")
STORE_LOG_INTERVAL_S = 10.0  # at most one line per this of responses not stored
STORE_RETRY_AFTER_S = 1
M = TypeVar("M", bound=BaseModel)
G = TypeVar("G", ChatCompletionRequest, CompletionRequest)

# nginx's code for "the client closed the connection"; nobody reads it, logs do.
_CLIENT_CLOSED = 499

# The generation routes (their requests count in the request metrics), with their names in logs.
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_RESPONSES, _MESSAGES = "/v1/responses", "/v1/messages"
_GENERATION_PATHS = {_CHAT: "chat.completions", _COMPLETIONS: "completions",
                     _RESPONSES: "responses", _MESSAGES: "messages"}


class ClientDisconnected(Exception):
    """The client went away before the response started."""


def create_http_app(gateway: Gateway, abort_connection: AbortConnection | None = None) -> FastAPI:
    """Build the ASGI app around a gateway (served by ``FrontEnds``, runner.py).
    ``abort_connection`` drops a slow client's connection (http_app.py)."""
    # FastAPI's own request spans stay off: the gateway.request span (core.py) is the
    # HTTP and gRPC server span alike, and probes of /health and /metrics are not traced.
    app = FastAPI(title="Tandem", version=version(), docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", telemetry={"tracing": False})
    _add_schemas(app, ChatCompletionRequest, CompletionRequest, ResponsesRequest,
                 MessagesRequest, TokenizeRequest, DetokenizeRequest)
    app.state.gateway = gateway

    def body_refused(scope: Scope, error: GatewayError) -> None:
        # Refused before the app: a generation request counts like those the app refuses.
        operation = _GENERATION_PATHS.get(scope["path"])
        if operation is not None and scope["method"] == "POST":
            gateway.refused(operation, error, Headers(scope=scope).get("authorization"))

    app.add_middleware(BodyLimitMiddleware, max_bytes=gateway.config.max_body_bytes,
                       on_refusal=body_refused)
    app.add_middleware(RequestIdMiddleware)  # outside the body limit: its 413s echo it too
    if gateway.config.cors_allow_origins:  # browsers' cross-origin calls, opt-in
        app.add_middleware(CORSMiddleware, allow_origins=list(gateway.config.cors_allow_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["x-request-id", "retry-after"])
    token_text = TokenText(gateway.tokenizer)
    # /v1/responses' conversation state (responses_api.py): in Redis where there is one
    stored = (ResponseStore() if gateway.config.responses_redis_url is None
              else RedisResponseStore(gateway.config.responses_redis_url))
    app.state.responses = stored
    store_failures = LogSampler(STORE_LOG_INTERVAL_S)

    def event_stream(choices: Choices, events: AsyncGenerator[bytes, None],
                     failed: Callable[[GatewayError], bytes] = _chat_failure) -> EventStream:
        return EventStream(choices, events, gateway.config.client_read_timeout_s,
                           abort_connection, failed)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> Response:
        headers = ({"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None
                   else None)
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error = GatewayError(exc.status_code, str(exc.detail),
                             type="not_found_error" if exc.status_code == 404
                             else "invalid_request_error")
        return JSONResponse(error.to_json(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        log.exception("internal error", exc_info=exc)
        error = GatewayError(500, "Internal server error.", type="server_error")
        return JSONResponse(error.to_json(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        problem = gateway.health_problem()
        if problem is not None:  # no worker of some role can serve: take us out of rotation
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/-/healthz", include_in_schema=False)
    async def serve_healthz() -> Response:
        # Ray Serve's proxy health contract, which KubeRay probes on the head's HTTP port.
        healthy = gateway.health_problem() is None
        return PlainTextResponse("success" if healthy else "unhealthy",
                                 status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if gateway.config.metrics_require_key:
            gateway.authenticate(request.headers.get("authorization"))
        if gateway.refresh_stats is not None:
            await gateway.refresh_stats()
        body, content_type = gateway.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", responses=_error_responses(401))
    async def list_models(request: Request) -> dict[str, object]:
        gateway.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(gateway, name)
                                           for name in gateway.model_names]}

    @app.get("/v1/models/{model:path}", responses=_error_responses(401, 404))
    async def get_model(model: str, request: Request) -> dict[str, object]:
        gateway.authenticate(request.headers.get("authorization"))
        gateway.check_model(model)
        return _model_card(gateway, model)

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest),
              responses=_error_responses(400, 401, 404))
    async def tokenize(request: Request) -> dict[str, object]:
        gateway.authenticate(request.headers.get("authorization"))
        body = (await _parse(request, TokenizeRequest)).checked()
        gateway.check_model(body.model)
        if body.messages is not None:
            tokens = tokenize_chat(gateway.tokenizer, template_messages(body.messages))
        else:
            tokens = tokenize_prompt(gateway.tokenizer, body.prompt or "")
        return {"count": len(tokens), "max_model_len": gateway.max_model_len, "tokens": tokens}

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest),
              responses=_error_responses(400, 401, 404))
    async def detokenize(request: Request) -> dict[str, object]:
        gateway.authenticate(request.headers.get("authorization"))
        body = await _parse(request, DetokenizeRequest)
        gateway.check_model(body.model)
        tokens = check_token_ids(body.tokens, gateway.tokenizer.vocab_size, param="tokens")
        return {"prompt": gateway.tokenizer.decode(tokens)}

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": version()}

    async def chat_request(body: ChatCompletionRequest, tenant: str, trace: RequestTrace,
                           arrival: float, request_id: str
                           ) -> tuple[GenerationRequest, list[int], bool | None, frozenset[int]]:
        """A checked chat request tokenized and built: the request, its prompt, whether its
        reply starts in reasoning (None: reasoning not parsed) and the special tokens whose
        text the reply keeps (a tool-call parser's tags, under auto)."""
        with trace.phase("gateway.tokenize") as span:
            functions = body.functions()
            own = gateway.tokenizer.template_renders_tools
            messages = body.chat_messages()
            rendered = with_tools(messages, functions, own) if functions else messages
            specs = [f.spec() for f in functions] if own else None
            prompt = await gateway.tokenize("messages", text_chars(messages), partial(
                tokenize_chat, gateway.tokenizer, rendered, specs,
                body.template_kwargs(), bool(body.add_special_tokens)))
            span.set_attribute("tandem.prompt_tokens", len(prompt))
        # Reasoning apart (gateway/reasoning.py): None where it is not parsed (off, or the
        # output held to a grammar from its first token); else whether the reply starts inside
        # a <think> the template opened.
        thinking = (starts_in_reasoning(prompt, gateway.tokenizer)
                    if gateway.reasoning and body.structured_output_field() is None else None)
        options = body.sampling_options()
        if body.tool_mode() == "auto" and options.structured_output is None:
            options = dataclasses.replace(options, structured_output=(
                await gateway.auto_tool_constraint(functions,
                                                   body.parallel_tool_calls is not False)))
        greq = gateway.build_request(request_id, prompt, options, body.salt(), arrival,
                                     prompt_param="messages", tenant=tenant,
                                     session=body.session())
        if not body.stream:
            gateway.check_buffered(greq, body.n)
        keep = gateway.tool_tag_ids if body.tool_mode() == "auto" else frozenset()
        return greq, prompt, thinking, keep

    @app.post(_CHAT, openapi_extra=_json_body(ChatCompletionRequest),
              responses=_generation_responses())
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        trace = RequestTrace("http", "chat.completions", request.headers)
        with trace.guard(aborts=(ClientDisconnected,)):
            with gateway.refusals(_GENERATION_PATHS[_CHAT], request.headers.get("authorization"),
                                  gone=(ClientDisconnected,)):
                tenant, body = await _checked(gateway, request, ChatCompletionRequest, trace)
                greq, prompt, thinking, keep = await chat_request(
                    body, tenant, trace, arrival, new_request_id("chatcmpl"))
            ctx = ResponseContext(greq.request_id, int(time.time()), gateway.model_name,
                                  token_text, body.return_token_ids)
            if body.stream:
                choices = await _unless_disconnected(
                    request, start_choices(gateway, greq, body.n, trace, keep))
                return event_stream(choices, _chat_events(choices, ctx, body, thinking,
                                                          gateway.tool_parser))
            merged = await _unless_disconnected(request, _run(gateway, greq, body.n, trace,
                                                              keep))
            return JSONResponse(ctx.chat_completion(
                [ctx.chat_choice(delta, body.logprobs, i,
                                 *_reply(delta, body, thinking, gateway.tool_parser))
                 for i, delta in enumerate(merged)],
                total_usage([delta.usage for delta in merged]), prompt))

    @app.post(_RESPONSES, openapi_extra=_json_body(ResponsesRequest),
              responses=_generation_responses())
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API over the chat path (gateway/responses_api.py)."""
        arrival = time.monotonic()
        trace = RequestTrace("http", "responses", request.headers)
        with trace.guard(aborts=(ClientDisconnected,)):
            with gateway.refusals(_GENERATION_PATHS[_RESPONSES],
                                  request.headers.get("authorization"),
                                  gone=(ClientDisconnected,)):
                with trace.phase("gateway.parse"):
                    tenant = gateway.caller(request.headers.get("authorization"))
                    given = await _parse(request, ResponsesRequest)
                    gateway.check_model(given.model)
                    if error := given.unsupported_fields():
                        raise error
                    turns = input_messages(given.input)
                    earlier = ([] if given.previous_response_id is None else
                               await _from_store(stored.history(tenant,
                                                                given.previous_response_id)))
                    body = _validated(ChatCompletionRequest, to_chat(given, earlier + turns))
                    if error := body.unsupported_fields():
                        raise error
                    await gateway.check_structured_output(body.structured_output_field())
                response_id = new_id("resp")
                greq, _, thinking, keep = await chat_request(body, tenant, trace, arrival,
                                                             response_id)

            async def keep_turns(reply: Reply, response: dict[str, Any]) -> None:
                """Stored before the client has the response: a next request naming it
                finds it. A store that fails loses only the chain (logged), not the answer."""
                if not given.store:
                    return
                try:
                    await stored.put(tenant, given.previous_response_id,
                                     turns + turns_of(reply), response)
                except StoreUnavailable as exc:
                    gateway.metrics.store_failures.labels(gateway.model_name).inc()
                    if (left_out := store_failures.allow("put")) is not None:
                        log.error("response %s not stored: %s (%d more not logged)",
                                  response_id, exc, left_out)

            if given.stream:
                choices = await _unless_disconnected(
                    request, start_choices(gateway, greq, 1, trace, keep))
                events = ResponseEvents(response_id, gateway.model_name, given)

                async def response_events() -> AsyncGenerator[bytes, None]:
                    async for chunk in _api_events(choices, events, body, thinking,
                                                   gateway.tool_parser):
                        yield chunk
                    if events.finished is not None:
                        await keep_turns(events.finished, events.response)
                        yield sse_event(events.terminal())

                return event_stream(choices, response_events(),
                    lambda error: sse_event(events.event(
                        "error", code=error.code or error.type, message=error.message,
                        param=error.param)))
            merged, = await _unless_disconnected(request, _run(gateway, greq, 1, trace, keep))
            (content, calls), reasoning = _reply(merged, body, thinking, gateway.tool_parser)
            reply = Reply(content, calls, reasoning, merged.finish_reason, merged.usage)
            response = response_json(response_id, int(time.time()), gateway.model_name, given,
                                     output_items(reply, OutputIds()), reply)
            await keep_turns(reply, response)
            return JSONResponse(response)

    @app.get(f"{_RESPONSES}/{{response_id}}", responses=_error_responses(401, 404))
    async def stored_response(request: Request, response_id: str) -> dict[str, Any]:
        tenant = gateway.authenticate(request.headers.get("authorization"))
        response = await _from_store(stored.get(tenant, response_id))
        if response is None:
            raise _no_response(response_id)
        return response

    @app.delete(f"{_RESPONSES}/{{response_id}}", responses=_error_responses(401, 404))
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        tenant = gateway.authenticate(request.headers.get("authorization"))
        if not await _from_store(stored.delete(tenant, response_id)):
            raise _no_response(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post(_MESSAGES, openapi_extra=_json_body(MessagesRequest),
              responses=_generation_responses(MessagesError))
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API over the chat path (gateway/messages_api.py); its errors
        are Anthropic's error objects. The API key comes as x-api-key (or a bearer token)."""
        arrival = time.monotonic()
        key = request.headers.get("x-api-key")
        authorization = f"Bearer {key}" if key else request.headers.get("authorization")
        trace = RequestTrace("http", "messages", request.headers)
        try:
            with trace.guard(aborts=(ClientDisconnected,)):
                with gateway.refusals(_GENERATION_PATHS[_MESSAGES], authorization,
                                      gone=(ClientDisconnected,)):
                    with trace.phase("gateway.parse"):
                        tenant = gateway.caller(authorization)
                        given = await _parse(request, MessagesRequest)
                        gateway.check_model(given.model)
                        if error := given.unsupported_fields():
                            raise error
                        body = _validated(ChatCompletionRequest, to_messages_chat(given))
                        if error := body.unsupported_fields():
                            raise error
                        await gateway.check_structured_output(body.structured_output_field())
                    message_id = new_message_id()
                    greq, prompt, thinking, keep = await chat_request(body, tenant, trace,
                                                                      arrival, message_id)
                if given.stream:
                    choices = await _unless_disconnected(
                        request, start_choices(gateway, greq, 1, trace, keep))
                    events = MessageEvents(message_id, gateway.model_name, len(prompt))
                    return event_stream(choices, _api_events(
                        choices, events, body, thinking, gateway.tool_parser),
                        lambda error: sse_event(message_error_json(error)))
                merged, = await _unless_disconnected(request,
                                                     _run(gateway, greq, 1, trace, keep))
        except GatewayError as error:
            headers = ({"Retry-After": str(error.retry_after_s)}
                       if error.retry_after_s is not None else None)
            return JSONResponse(message_error_json(error), status_code=error.status,
                                headers=headers)
        (content, calls), reasoning = _reply(merged, body, thinking, gateway.tool_parser)
        return JSONResponse(message_json(
            message_id, gateway.model_name, content_blocks(content, calls, reasoning),
            stop_reason(merged.finish_reason, merged.stop_string, calls), merged.stop_string,
            message_usage(merged.usage, len(prompt))))

    @app.post(_COMPLETIONS, openapi_extra=_json_body(CompletionRequest),
              responses=_generation_responses())
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        trace = RequestTrace("http", "completions", request.headers)
        with trace.guard(aborts=(ClientDisconnected,)):
            with gateway.refusals(_GENERATION_PATHS[_COMPLETIONS],
                                  request.headers.get("authorization"),
                                  gone=(ClientDisconnected,)):
                tenant, body = await _checked(gateway, request, CompletionRequest, trace)
                with trace.phase("gateway.tokenize") as span:
                    prompt_in = body.single_prompt()
                    prompt = (await gateway.tokenize("prompt", len(prompt_in), partial(
                                  tokenize_prompt, gateway.tokenizer, prompt_in,
                                  body.add_special_tokens is not False))
                              if isinstance(prompt_in, str)
                              else check_token_ids(prompt_in, gateway.tokenizer.vocab_size))
                    span.set_attribute("tandem.prompt_tokens", len(prompt))
                greq = gateway.build_request(new_request_id("cmpl"), prompt,
                                             body.sampling_options(), body.salt(), arrival,
                                             tenant=tenant, session=body.session())
                if not body.stream:
                    gateway.check_buffered(greq, body.best_of or body.n)
            ctx = ResponseContext(greq.request_id, int(time.time()), gateway.model_name,
                                  token_text, body.return_token_ids)
            want_logprobs = body.logprobs is not None
            echoed = ((prompt_in if isinstance(prompt_in, str)
                       else gateway.tokenizer.decode(prompt)) if body.echo else "")
            if body.stream:
                choices = await _unless_disconnected(
                    request, start_choices(gateway, greq, body.n, trace))
                return event_stream(choices,
                                    _completion_events(choices, ctx, body, echoed, prompt))
            best_of = body.best_of or body.n
            if best_of > body.n and greq.params.logprobs is None:  # ranked by their logprobs
                greq = dataclasses.replace(
                    greq, params=dataclasses.replace(greq.params, logprobs=0))
            merged = await _unless_disconnected(request, _run(gateway, greq, best_of, trace))
            usage = total_usage([delta.usage for delta in merged])
            prompt_logprobs = merged[0].prompt_logprobs  # choice 0 computed them for all
            if best_of > body.n:
                merged = sorted(merged, key=cumulative_logprob, reverse=True)[:body.n]
            choices_json = []
            for i, delta in enumerate(merged):
                _after_echo(delta, echoed)
                delta.text = echoed + delta.text
                choice = ctx.completion_choice(delta, want_logprobs, i)
                if echoed and want_logprobs:
                    choice["logprobs"] = ctx.echoed_logprobs(prompt, prompt_logprobs,
                                                             choice["logprobs"])
                choices_json.append(choice)
            return JSONResponse(ctx.completion(choices_json, usage, prompt))

    return app


# The OpenAPI document (/openapi.json, /docs). The generation routes parse their bodies themselves
# (``_parse``), so the document takes their schemas from the pydantic models.
_SCHEMA_REF = "#/components/schemas/{model}"
_ERROR_WHEN = {
    400: "Invalid JSON, a field of the wrong type or out of range, an unsupported feature, or a "
         "prompt over the context length; `param` names the field.",
    401: "API keys are configured and `Authorization: Bearer <key>` is missing or wrong.",
    404: "Unknown model.",
    413: "The request body is over the size limit.",
    429: "The server is overloaded: retry after `Retry-After` seconds.",
    500: "An internal failure.",
    503: "No worker can serve the request now: retry after `Retry-After` seconds.",
    504: "The request ran past its deadline (its `timeout`, or the server's limit).",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "integer"}}}


def _error_responses(*statuses: int, body: type[BaseModel] = ErrorResponse
                     ) -> dict[int | str, dict[str, Any]]:
    """Documented error responses, each with OpenAI's error body (or ``body``)."""
    return {status: {"model": body, "description": _ERROR_WHEN[status],
                     **({"headers": _RETRY_AFTER} if status in (429, 503) else {})}
            for status in statuses}


def _generation_responses(error: type[BaseModel] = ErrorResponse
                          ) -> dict[int | str, dict[str, Any]]:
    # Before OpenAPI 3.2's itemSchema, an event stream's schema describes each event.
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
             "description": "One server-sent event: a chunk as JSON, an error as JSON "
                            "(`{\"error\": {...}}`), or `[DONE]` last."}
    ok = {"description": "The completion as JSON or, with `stream: true`, its chunks as "
                         "server-sent events ending with `data: [DONE]`.",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": event}}}
    return {200: ok, **_error_responses(400, 401, 404, 413, 429, 500, 503, 504, body=error)}


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: the JSON body it parses itself as ``model`` (whose schema
    ``_add_schemas`` puts in the document's components)."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _add_schemas(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add the models' JSON schemas, and those of the models they use (pydantic's ``$defs``), to
    the OpenAPI document's ``components.schemas``, where ``_json_body`` refers to them."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template=_SCHEMA_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            build().setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _model_card(gateway: Gateway, name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": gateway.created,
            "owned_by": "tandem", "max_model_len": gateway.max_model_len}


async def _checked(gateway: Gateway, request: Request, model: type[G], trace: RequestTrace
                   ) -> tuple[str, G]:
    """A generation request's tenant and body, checked (its parse phase)."""
    with trace.phase("gateway.parse"):
        tenant = gateway.caller(request.headers.get("authorization"))
        body = await _parse(request, model)
        gateway.check_model(body.model)
        if error := body.unsupported_fields():
            raise error
        await gateway.check_structured_output(body.structured_output_field())
    return tenant, body


async def _parse(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_int=_bounded_int)
        _check_depth(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # ValueError: bad JSON, NaN/Infinity, huge integers, deep nesting.
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise bad_request(f"The request body is not valid JSON: {detail}", code="invalid_json"
                          ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


# JSON on the network: numbers must be finite, integers short, nesting shallow.
MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 32


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _check_depth(data: object) -> None:
    """Iteratively, so that the check itself cannot recurse too deeply."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _validation_error(exc: ValidationError) -> GatewayError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    messages = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return bad_request("Invalid request: " + "; ".join(messages) + more, param=param)


async def _run(gateway: Gateway, request: GenerationRequest, n: int = 1,
               trace: RequestTrace | None = None, keep: frozenset[int] = frozenset()
               ) -> list[Delta]:
    """Each of the request's ``n`` choices, run to its end."""
    return await (await start_choices(gateway, request, n, trace, keep)).collect()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts the generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the server's next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _chat_events(choices: Choices, ctx: ResponseContext, body: ChatCompletionRequest,
                       thinking: bool | None, parser: ToolParser
                       ) -> AsyncGenerator[bytes, None]:
    """``thinking``: see chat_completions (None: no reasoning parsed); ``parser``: how the
    replies write tool calls under auto."""
    include_usage = body.include_usage()

    def event(chunk: dict[str, object]) -> bytes:
        if include_usage:
            chunk["usage"] = None
        return sse(chunk)

    for index in range(body.n):
        yield event(ctx.chat_chunk(None, False, first=True, index=index))
    usages: list[Usage | None] = [None] * body.n
    # Reasoning apart and tool calls as they form (replies.ReplyReader); neither: the text as
    # it comes (no reader on the plain path).
    readers = ([_reader(body, thinking, parser) for _ in range(body.n)]
               if body.tool_mode() not in (None, "none") or thinking is not None else None)
    async for index, delta in choices:
        usages[index] = delta.usage or usages[index]
        reasoning, content, calls, called = "", delta.text, [], False
        if readers is not None:
            piece = readers[index].read(delta)
            reasoning, content, calls = piece.reasoning, piece.content, piece.calls
            called = bool(readers[index].calls)
        if (reasoning or content or calls or delta.finish_reason
                or (body.logprobs and delta.logprobs)
                or (body.return_token_ids and delta.token_ids)):
            yield event(ctx.chat_chunk(delta, body.logprobs, content=content, calls=calls,
                                       called=called, index=index, reasoning=reasoning))
    if include_usage:
        yield sse(ctx.usage_chunk("chat.completion.chunk", total_usage(usages)))
    yield SSE_DONE


def _reader(body: ChatCompletionRequest, thinking: bool | None, parser: ToolParser
            ) -> ReplyReader:
    return ReplyReader(body.functions(), body.tool_mode(), thinking, parser,
                       body.parallel_tool_calls is not False)


def _reply(merged: Delta, body: ChatCompletionRequest, thinking: bool | None,
           parser: ToolParser) -> tuple[tuple[str | None, list[ToolCall]], str | None]:
    """The reply's content and tool calls (gateway/tools.py), and its reasoning."""
    reasoning, text = (None, merged.text) if thinking is None else split_reasoning(
        merged.text, thinking)
    return parse_reply(text, body.functions(), body.tool_mode(), parser,
                       body.parallel_tool_calls is not False), reasoning


class _ApiEvents(Protocol):
    """A reply's events in an API's own shape (responses_api.ResponseEvents,
    messages_api.MessageEvents)."""

    def start(self) -> Iterable[dict[str, Any]]: ...
    def reasoning(self, text: str) -> Iterable[dict[str, Any]]: ...
    def content(self, text: str) -> Iterable[dict[str, Any]]: ...
    def calls(self, deltas: list[CallDelta]) -> Iterable[dict[str, Any]]: ...
    def finish(self, calls: list[ToolCall], last: Delta) -> Iterable[dict[str, Any]]: ...


async def _api_events(choices: Choices, events: _ApiEvents, body: ChatCompletionRequest,
                      thinking: bool | None, parser: ToolParser
                      ) -> AsyncGenerator[bytes, None]:
    """One streamed reply as named server-sent events: reasoning, content and tool calls as
    they form (``replies.ReplyReader``)."""
    for event in events.start():
        yield sse_event(event)
    reader = _reader(body, thinking, parser)
    async for _, delta in choices:
        piece = reader.read(delta)
        for event in (*events.reasoning(piece.reasoning), *events.content(piece.content),
                      *events.calls(piece.calls)):
            yield sse_event(event)
        if piece.last is not None:
            for event in events.finish(reader.calls, piece.last):
                yield sse_event(event)


def _validated(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


async def _from_store(call: Awaitable[T]) -> T:
    """A Responses store call; a store that does not answer is a 503 (retry later)."""
    try:
        return await call
    except StoreUnavailable as exc:
        raise unavailable(f"the stored responses cannot be read ({exc})",
                          retry_after_s=STORE_RETRY_AFTER_S) from None


def _no_response(response_id: str) -> GatewayError:
    return GatewayError(404, f"No response with id {response_id!r}", type="not_found_error",
                        param="response_id")


def _after_echo(delta: Delta, echoed: str) -> None:
    """``delta``'s text offsets counted from the start of its ``echo``ed prompt."""
    if echoed:
        delta.text_offsets = [offset + len(echoed) for offset in delta.text_offsets]


async def _completion_events(choices: Choices, ctx: ResponseContext, body: CompletionRequest,
                             echoed: str = "", prompt: list[int] | None = None
                             ) -> AsyncGenerator[bytes, None]:
    """``echoed``: the prompt's text (``echo``), sent first in each choice (with the prompt's
    logprobs, if asked, which choice 0's first delta carries)."""
    include_usage = body.include_usage()
    want_logprobs = body.logprobs is not None

    def event(chunk: dict[str, object]) -> bytes:
        if include_usage:
            chunk["usage"] = None
        return sse(chunk)

    usages: list[Usage | None] = [None] * body.n
    if echoed:
        prompt_logprobs = choices.generations[0].first.prompt_logprobs
        for index in range(body.n):
            chunk = ctx.completion_chunk(Delta(text=echoed), False, index)
            if want_logprobs:
                chunk["choices"][0]["logprobs"] = ctx.echoed_logprobs(prompt or [],
                                                                      prompt_logprobs)
            yield event(chunk)
    async for index, delta in choices:
        usages[index] = delta.usage or usages[index]
        _after_echo(delta, echoed)
        if (delta.text or delta.finish_reason or (want_logprobs and delta.logprobs)
                or (body.return_token_ids and delta.token_ids)):
            yield event(ctx.completion_chunk(delta, want_logprobs, index))
    if include_usage:
        yield sse(ctx.usage_chunk("text_completion", total_usage(usages)))
    yield SSE_DONE


AbortConnection = Callable[[Scope], None]  # drop the connection that carries this request


class EventStream(StreamingResponse):
    def __init__(self, generation: Choices, events: AsyncGenerator[bytes, None],
                 read_timeout_s: float | None, abort_connection: AbortConnection | None,
                 failed: Callable[[GatewayError], bytes]) -> None:
        """``failed``: the events that end a stream that failed after it started."""
        # The background task closes the generation even when the client leaves before the
        # body iterator ever starts (then ``_guarded``'s own cleanup never runs).
        self._chunks = _guarded(generation, events, failed)
        super().__init__(self._chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         background=BackgroundTask(generation.aclose))
        self.generation = generation
        self.read_timeout_s = read_timeout_s
        self.abort_connection = abort_connection
        self._scope: Scope | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async with contextlib.aclosing(self._chunks):
            async for chunk in self._chunks:
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                except TimeoutError:
                    assert self.read_timeout_s is not None
                    await self.generation.cut_slow_client(self.read_timeout_s)
                    if self.abort_connection is not None and self._scope is not None:
                        self.abort_connection(self._scope)
                        # The transport reports the lost connection on the loop's next turn;
                        # let it, so that the server sees a disconnect and not a half response.
                        await asyncio.sleep(0)
                    return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _chat_failure(error: GatewayError) -> bytes:
    """A failed stream's end, as OpenAI-compatible servers send it."""
    return sse(error.to_json()) + SSE_DONE


async def _guarded(generation: Choices, events: AsyncGenerator[bytes, None],
                   failed: Callable[[GatewayError], bytes]) -> AsyncGenerator[bytes, None]:
    """Close the generation however the stream ends (done, failed, client gone); a failure after
    the headers went out becomes the API's error event (``failed``)."""
    try:
        async with contextlib.aclosing(events):
            async for chunk in events:
                yield chunk
    except Exception as exc:
        if isinstance(exc, GatewayError):
            error = exc
        else:
            log.exception("stream failed", exc_info=exc)
            error = GatewayError(500, "Internal server error.", type="server_error")
        yield failed(error)
    finally:
        await generation.aclose()


# -- Request body limit ------------------------------------------------------------------------
# ASGI middleware: refuse request bodies over a size limit with 413, before any parsing. A
# declared Content-Length over the limit is refused at once; a chunked body is counted as it
# arrives. Accepted bodies are buffered (they are small by definition) and replayed to the app,
# after which ``receive`` goes to the server again so disconnects are still seen.


Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Before refusing a body, read and drop up to this much of it: a client still uploading (most
# read nothing until they have sent everything) then gets the 413 instead of a reset connection.
# The server stops handing out the body once a response is complete, so this must come first.
_DRAIN_LIMIT = 64 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_refusal: Callable[[Scope, GatewayError], None] | None = None) -> None:
        """``on_refusal``: told of each request refused here (to count and log it)."""
        self.app = app
        self.max_bytes = max_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if isinstance(declared, GatewayError):
            await self._reject(scope, send, declared)
            return
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, declared)
            await self._reject(scope, send, body_too_large(self.max_bytes))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was in
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, _DRAIN_LIMIT)
                await self._reject(scope, send, body_too_large(self.max_bytes))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _reject(self, scope: Scope, send: Send, error: GatewayError) -> None:
        if self.on_refusal is not None:
            self.on_refusal(scope, error)
        await _respond(send, error)


# ASGI middleware: a request's ``X-Request-Id`` (visible ASCII, at most 128 characters) comes
# back on its response, refusals and errors included, so a client or proxy can match them; the
# server's own request ids stay its own (a client's id is never a key).
_MAX_REQUEST_ID = 128


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = next((value for name, value in scope.get("headers", ())
                      if name == b"x-request-id"), None) if scope["type"] == "http" else None
        if not given or len(given) > _MAX_REQUEST_ID or not all(33 <= b < 127 for b in given):
            await self.app(scope, receive, send)
            return

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, echo)


def _content_length(scope: Scope) -> int | GatewayError | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = -1
            if length < 0:
                return bad_request("Content-Length is not a valid length")
            return length
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(send: Send, error: GatewayError) -> None:
    body = json.dumps(error.to_json()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain(receive: Receive, limit: int) -> None:
    drained = 0
    while drained <= min(limit, _DRAIN_LIMIT):
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))


# -- Connection deadlines ----------------------------------------------------------------------
# uvicorn times out only an idle keep-alive connection: one that never finishes its headers,
# or announces a body and trickles it, would hold its connection (and its buffered bytes) for
# ever. These deadlines close it, with 408 when no response started.

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                     b"content-length: 28\r\nconnection: close\r\n\r\n"
                     b"request not received in time")


def deadline_protocol(header_timeout_s: float, body_timeout_s: float,
                      on_cut: Callable[[str], None]) -> type:
    """uvicorn's httptools protocol with a deadline on each request's headers (from the
    connection's opening, then from each request's first byte) and on its body (from the end
    of its headers); ``on_cut(reason)`` counts each connection cut (header_timeout,
    body_timeout)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class DeadlineProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # noqa: ANN401
            super().connection_made(transport)
            self._arm(header_timeout_s, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(header_timeout_s, "header_timeout")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_timeout_s, "body_timeout")

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, timeout_s: float, reason: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._cut, reason)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _cut(self, reason: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = getattr(self, "cycle", None)
            if cycle is None or not cycle.response_started:
                self.transport.write(_TIMEOUT_RESPONSE)
            log.info("connection from %s cut: %s", self.client, reason.replace("_", " "))
            on_cut(reason)
            self.transport.close()

    return DeadlineProtocol
