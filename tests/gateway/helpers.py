"""Shared helpers for the gateway tests: engine references and deadline polling."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from services.engine.async_engine import AsyncEngine
from services.engine.sampling_params import SamplingParams


def engine_tokens(engine: AsyncEngine, prompt: list[int], max_tokens: int,
                  **params: object) -> list[int]:
    """The engine's own output for a prompt, called directly (no gateway)."""

    async def run() -> list[int]:
        ids: list[int] = []
        sampling = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **params})
        async for out in engine.generate(f"ref-{uuid.uuid4().hex}", prompt, sampling):
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
