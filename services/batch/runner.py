"""The batch driver: the requests in prefix order, a bounded number in flight, each answer
appended to the output as soon as it arrives.

It is an HTTP client of the gateway's OpenAI API and nothing else: the same code runs against
a running cluster (an ``httpx.AsyncClient`` on its URL) and against an in-process engine (the
gateway's own ASGI app behind ``httpx.ASGITransport``), so every answer is exactly what the
online API gives for that request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
from tqdm import tqdm

from services.batch.batch_file import BatchRequest, error_line, response_line, write_line

# Answers that mean "not now": the request is sent again after the server's Retry-After.
RETRY_STATUSES = frozenset({429, 503})
MAX_ATTEMPTS = 5  # per request, for those statuses and for transport errors
MAX_RETRY_WAIT_S = 30.0


@dataclass
class Summary:
    """What one run did (requests already answered by an earlier run not counted)."""

    requests: int = 0
    failed: int = 0  # answered with a status other than 200, or not answered at all
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    def add(self, line: dict[str, Any]) -> None:
        self.requests += 1
        response = line["response"]
        if response is None or response["status_code"] != 200:
            self.failed += 1
            return
        body = response["body"]
        usage = (body.get("usage") if isinstance(body, dict) else None) or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        return (f"{self.requests} requests ({self.failed} failed), {self.prompt_tokens} prompt "
                f"({self.cached_tokens} cached) + {self.completion_tokens} completion tokens in "
                f"{self.elapsed_s:.1f} s: {self.output_tokens_per_s:.1f} output tokens/s")


def in_prefix_order(requests: Sequence[BatchRequest], done: Collection[str]
                    ) -> list[BatchRequest]:
    """The requests not yet answered, those sharing a prompt prefix next to each other (so
    they are in flight together, or one after another, and hit the prefix cache)."""
    return sorted((r for r in requests if r.custom_id not in done),
                  key=BatchRequest.prefix_key)


async def run(requests: Sequence[BatchRequest], client: httpx.AsyncClient, out: TextIO,
              concurrency: int, progress: tqdm | None = None) -> Summary:  # type: ignore[type-arg]
    """Send ``requests`` in their order, ``concurrency`` at a time, through ``client`` (whose
    base URL is the server's, without ``/v1``); write each answer's line to ``out`` as it
    arrives (so in the order they finish)."""
    summary = Summary()
    pending = iter(requests)
    start = time.perf_counter()

    async def worker() -> None:
        for request in pending:  # one iterator shared by the workers: each takes the next
            line = await answer(client, request)
            write_line(out, line)
            summary.add(line)
            if progress is not None:
                progress.update()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(requests))))))
    summary.elapsed_s = time.perf_counter() - start
    return summary


async def answer(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any]:
    """The output line of one request: the server's answer, whatever its status, once it is
    not a "not now" (429, 503; retried after Retry-After) or after ``MAX_ATTEMPTS``; a
    ``request_failed`` error when the server could not be reached that many times."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        last = attempt == MAX_ATTEMPTS
        try:
            response = await client.post(request.url, json=request.body)
        except httpx.TransportError as exc:
            if last:
                return error_line(request.custom_id, "request_failed",
                                  f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(min(2.0 ** attempt, MAX_RETRY_WAIT_S))
            continue
        if response.status_code in RETRY_STATUSES and not last:
            await asyncio.sleep(_retry_after_s(response, attempt))
            continue
        try:
            body: Any = response.json()
        except ValueError:  # not JSON (a proxy's error page): kept as text
            body = response.text
        return response_line(request.custom_id, response.status_code, body)
    raise AssertionError("unreachable")


def _retry_after_s(response: httpx.Response, attempt: int) -> float:
    try:
        wait = float(response.headers.get("retry-after", ""))
    except ValueError:
        wait = 2.0 ** attempt
    return min(max(wait, 0.1), MAX_RETRY_WAIT_S)
