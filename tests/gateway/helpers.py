"""Shared helpers for the gateway tests: served gateways, engine references, deadline polling."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator

import openai

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import GatewayServer, ServeAddresses
from tandem.services.protocol.request import GenerationRequest, SamplingParams

FUZZ_MAX_TOKENS = 4  # no fuzzed call runs longer than this many tokens (conftest's fuzz_server)


@contextlib.contextmanager
def serving(gateway: Gateway) -> Iterator[ServeAddresses]:
    """The gateway's HTTP and gRPC front ends on free loopback ports, for the block."""
    server = GatewayServer(gateway, http_port=0, grpc_port=0)
    try:
        yield server.start()
    finally:
        server.stop()


def engine_tokens(engine: AsyncEngine, prompt: list[int], max_tokens: int,
                  **params: object) -> list[int]:
    """The engine's own output for a prompt, called directly (no gateway)."""

    async def run() -> list[int]:
        ids: list[int] = []
        sampling = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **params})
        async for out in engine.generate(GenerationRequest(
            f"ref-{uuid.uuid4().hex}", prompt, sampling)):
            ids += out.new_token_ids
        return ids

    return asyncio.run(run())


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def wait_engine_idle(engine: AsyncEngine, timeout_s: float = 30.0) -> None:
    """Every request gone and every KV block free again (cached-but-free blocks count as free)."""

    def idle() -> bool:
        s = engine.stats
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks

    wait_until(idle, "the engine to be idle with all KV blocks free", timeout_s)


def cached_tokens(client: openai.OpenAI, prompt: list[int], salt: str | None = None) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a one-token greedy completion."""
    extra = {"cache_salt": salt} if salt else {}
    reply = client.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body=extra)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0
