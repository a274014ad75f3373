"""Streaming client for Tandem's gRPC API (``tandem.v1.Generation/Generate``).

The generated stubs live in services/gateway/pb (from proto/tandem/v1/generation.proto) and are
imported on first use, so HTTP-only runs never need grpcio or the gateway package.
"""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

from tandem.loadtest.bench.clients import (
    PREFLIGHT_TIMEOUT_S,
    ClientOptions,
    Target,
    TargetError,
    finish_output_count,
)
from tandem.loadtest.bench.workloads import BenchRequest
from tandem.services.protocol.bench_records import RequestRecord


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """(generation_pb2, generation_pb2_grpc), or TargetError saying what is missing."""
    try:
        from tandem.services.gateway.pb import generation_pb2, generation_pb2_grpc
    except ImportError as exc:
        raise TargetError(f"Tandem's gRPC stubs are not importable ({exc}); generate them with "
                          "`python -m tandem.services.gateway.protogen` or use --protocol http"
                          ) from exc
    return generation_pb2, generation_pb2_grpc


class GrpcClient:
    def __init__(self, target: Target, options: ClientOptions) -> None:
        import grpc

        self._grpc = grpc
        self._pb, pb_grpc = load_stubs()
        self.target = target
        self.options = options
        self.model = options.model or ""  # empty: the served model
        self._channel = grpc.aio.insecure_channel(target.address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = ((("authorization", f"Bearer {options.api_key}"),)
                          if options.api_key else None)

    async def preflight(self) -> str:
        # channel_ready() alone would keep retrying a refused connection until the timeout.
        states = self._grpc.ChannelConnectivity
        what = f"cannot reach gRPC target {self.target.address}"
        try:
            async with asyncio.timeout(PREFLIGHT_TIMEOUT_S):
                state = self._channel.get_state(try_to_connect=True)
                while state != states.READY:
                    if state in (states.TRANSIENT_FAILURE, states.SHUTDOWN):
                        raise TargetError(f"{what} (connection failed)")
                    await self._channel.wait_for_state_change(state)
                    state = self._channel.get_state(try_to_connect=True)
        except TimeoutError as exc:
            raise TargetError(f"{what} (not ready after {PREFLIGHT_TIMEOUT_S:g} s)") from exc
        return self.model

    async def aclose(self) -> None:
        await self._channel.close()

    def _request(self, request: BenchRequest) -> Any:
        pb = self._pb
        sampling = pb.SamplingOptions(max_tokens=request.max_tokens,
                                      temperature=self.options.temperature,
                                      ignore_eos=self.options.ignore_eos)
        message = pb.GenerateRequest(model=self.model, sampling=sampling)
        if request.messages is not None and self.options.endpoint == "chat":
            message.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content)
                                         for m in request.messages)
        elif request.prompt is not None:
            message.prompt = request.prompt
        else:
            raise ValueError(f"request {request.index} has no prompt for the "
                             f"{self.options.endpoint} endpoint")
        return message

    async def send(self, request: BenchRequest, origin: float) -> RequestRecord:
        message = self._request(request)
        record = RequestRecord(request.index, request.kind, request.group,
                               request.prompt_tokens, start_s=time.perf_counter() - origin)
        text: list[str] = []
        usage_tokens: int | None = None
        streamed_ids = 0
        try:
            call = self._stub.Generate(message, metadata=self._metadata,
                                       timeout=self.options.request_timeout_s)
            async for response in call:
                record.admitted = True
                now = time.perf_counter() - origin
                if response.token_ids or response.text:
                    if record.first_token_s is None:
                        record.first_token_s = now
                    record.chunk_times_s.append(now)
                    text.append(response.text)
                    streamed_ids += len(response.token_ids)
                if response.HasField("usage"):
                    usage_tokens = response.usage.completion_tokens
                    record.server_prompt_tokens = response.usage.prompt_tokens
                    record.cached_tokens = response.usage.cached_tokens
        except self._grpc.aio.AioRpcError as exc:
            record.error = f"gRPC {exc.code().name}: {exc.details()}"
            # Overload, like HTTP 429: RESOURCE_EXHAUSTED with Retry-After (a body too large
            # gets it without), before any message.
            trailers = exc.trailing_metadata() or ()
            record.rejected = (not record.admitted and any(k == "retry-after" for k, _ in trailers)
                               and exc.code() is self._grpc.StatusCode.RESOURCE_EXHAUSTED)
            return record
        record.end_s = time.perf_counter() - origin
        if usage_tokens is None and streamed_ids:
            record.output_tokens, record.output_tokens_source = streamed_ids, "token_ids"
        else:
            finish_output_count(record, usage_tokens, "".join(text), self.options)
        if record.first_token_s is None:
            record.error = "the stream carried no output"
        return record
