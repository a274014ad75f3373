"""TEST PEER: a tiny real OpenAI-compatible streaming server for the bench's end-to-end tests.

It stands in for Tandem's gateway (and for any third-party server) so that the client, metrics
and report run against real HTTP and SSE on 127.0.0.1. It tokenizes prompts with the bench's
tokenizer, so its usage.prompt_tokens is the true count, and streams ``max_tokens`` tokens in
chunks of one or two tokens (so chunk counts differ from token counts and only the usage field
gives the right answer). Every usage it sends is logged for the tests to compare against.
``/metrics`` serves Tandem's prefix-cache counters (one worker, role ``prefill``): the prompt
tokens of finished streams as queries, ``cache_hit_fraction`` of them as hits.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem.services.engine.tokenizer import Tokenizer

MODEL = "peer-model"


@dataclass
class PeerBehaviour:
    step_s: float = 0.0  # pause before each chunk: a stand-in decode step
    fail_every: int = 0  # every n-th request answers HTTP 500 (0: never)
    break_every: int = 0  # every n-th stream ends with an error event after its first chunk
    stall: bool = False  # never finish a stream (for deadline tests)
    api_key: str | None = None
    cache_hit_fraction: float = 0.0  # of prompt tokens, as /metrics reports them


@dataclass
class PeerLog:
    usages: list[dict[str, Any]] = field(default_factory=list)  # one per finished stream
    requests: int = 0
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each generation
    prompt_tokens: int = 0  # over finished streams


class _CacheCounters(Collector):
    def __init__(self, behaviour: PeerBehaviour, log: PeerLog) -> None:
        self.behaviour, self.log = behaviour, log

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker"]
        queries = CounterMetricFamily("tandem_prefix_cache_queries", "q", labels=labels)
        queries.add_metric([MODEL, "peer"], self.log.prompt_tokens)
        hits = CounterMetricFamily("tandem_prefix_cache_hits", "h", labels=labels)
        hits.add_metric([MODEL, "peer"], self.log.prompt_tokens * self.behaviour.cache_hit_fraction)
        blocks = GaugeMetricFamily("tandem_kv_cache_blocks", "b", labels=[*labels, "role"])
        blocks.add_metric([MODEL, "peer", "prefill"], 100)
        yield from (queries, hits, blocks)


def _chunk_sizes(n: int) -> list[int]:
    sizes, left, k = [], n, 0
    while left:
        size = min(left, 1 + k % 2)  # 1, 2, 1, 2, ...
        sizes.append(size)
        left -= size
        k += 1
    return sizes


def create_app(tokenizer: Tokenizer, behaviour: PeerBehaviour, log: PeerLog) -> Starlette:
    stalled = asyncio.Event()  # never set

    def authorized(request: Request) -> bool:
        return behaviour.api_key is None or \
            request.headers.get("authorization") == f"Bearer {behaviour.api_key}"

    async def models(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        log.requests += 1
        log.arrivals.append(time.monotonic())
        if behaviour.fail_every and log.requests % behaviour.fail_every == 0:
            return JSONResponse({"error": {"message": "peer failure"}}, status_code=500)
        chat = request.url.path.endswith("/chat/completions")
        prompt_tokens = (len(tokenizer.encode_chat(body["messages"])) if chat
                         else len(tokenizer.encode(body["prompt"])))
        max_tokens = int(body["max_tokens"])
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        obj = "chat.completion.chunk" if chat else "text_completion"
        breaks = bool(behaviour.break_every) and log.requests % behaviour.break_every == 0

        def event(data: dict[str, Any] | str) -> bytes:
            return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        async def stream() -> AsyncIterator[bytes]:
            if chat:  # the role chunk comes before any token, as Tandem and vLLM send it
                yield event({"object": obj, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None}]})
            if behaviour.stall:
                await stalled.wait()
            sizes = _chunk_sizes(max_tokens)
            for k, size in enumerate(sizes):
                if behaviour.step_s:
                    await asyncio.sleep(behaviour.step_s)
                finish = "length" if k == len(sizes) - 1 else None
                yield event({"object": obj, "choices": [choice(" tok" * size, finish)]})
                if breaks:  # as Tandem's gateway ends a failed stream: an error event, [DONE]
                    yield event({"error": {"message": "peer broke", "type": "server_error"}})
                    yield event("[DONE]")
                    return
            if include_usage:
                yield event({"object": obj, "choices": [], "usage": usage})
            log.usages.append(usage)
            log.prompt_tokens += prompt_tokens
            yield event("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    registry = CollectorRegistry()
    registry.register(_CacheCounters(behaviour, log))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain")

    return Starlette(routes=[
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ])


@contextmanager
def serve_peer(tokenizer: Tokenizer, behaviour: PeerBehaviour | None = None
               ) -> Iterator[tuple[str, PeerLog]]:
    """Serve the peer on 127.0.0.1 in a thread; yields (base URL, log)."""
    log = PeerLog()
    app = create_app(tokenizer, behaviour or PeerBehaviour(), log)
    # Listening before the server thread starts: early connections wait in the backlog.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
