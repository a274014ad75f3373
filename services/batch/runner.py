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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from tandem.services.batch.batch_file import BatchRequest, response_line

# Answers that mean "not now" (the server is full, or a worker is being replaced): the
# request is sent again after the server's Retry-After.
RETRY_STATUSES = frozenset({429, 503})
# Tries of one request that got no answer or only "not now", waiting between them up to
# MAX_RETRY_WAIT_S (~3 minutes in all); then the run stops.
MAX_ATTEMPTS = 10
MAX_RETRY_WAIT_S = 30.0


class ServerUnusable(ValueError):
    """Before any request: the server does not answer, or refuses the API key (the CLI's
    usage error, exit 2)."""


class ServerGone(RuntimeError):
    """A request got no answer, or only "not now", ``MAX_ATTEMPTS`` times: the run stops;
    the requests without an output line are sent by the next run."""


@dataclass
class Summary:
    """What one run did (requests already answered by an earlier run not counted)."""

    requests: int = 0
    failed: int = 0  # answered with a status other than 200
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    def add(self, line: dict[str, Any]) -> None:
        self.requests += 1
        response = line["response"]
        if response["status_code"] != 200:
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


async def run(requests: Sequence[BatchRequest], client: httpx.AsyncClient,
              write: Callable[[dict[str, Any]], None], concurrency: int,
              progress: tqdm | None = None) -> Summary:  # type: ignore[type-arg]
    """Send ``requests`` in their order, ``concurrency`` at a time, through ``client`` (whose
    base URL is the server's, without ``/v1``); ``write`` each answer's line as it arrives
    (so in the order they finish)."""
    summary = Summary()
    pending = iter(requests)
    start = time.perf_counter()

    async def worker() -> None:
        for request in pending:  # one iterator shared by the workers: each takes the next
            line = await answer(client, request)
            write(line)
            summary.add(line)
            if progress is not None:
                progress.update()

    try:
        async with asyncio.TaskGroup() as workers:  # one fails: the others are cancelled
            for _ in range(max(1, min(concurrency, len(requests)))):
                workers.create_task(worker())
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    summary.elapsed_s = time.perf_counter() - start
    return summary


async def check_server(client: httpx.AsyncClient) -> None:
    """``ServerUnusable`` unless the server lists its models to this client (reachable, and
    the API key, if any, accepted). Closes the client."""
    try:
        async with client:
            response = await client.get("/v1/models")
    except httpx.TransportError as exc:
        raise ServerUnusable(f"{client.base_url} does not answer ({type(exc).__name__}: "
                             f"{exc})") from None
    if response.status_code != 200:
        raise ServerUnusable(f"{client.base_url}/v1/models answered {response.status_code}: "
                             f"{response.text[:300]}")


async def answer(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any]:
    """The output line of one request: the server's answer, whatever its status, except a
    "not now" (429, 503: sent again after Retry-After). ``ServerGone`` after
    ``MAX_ATTEMPTS`` tries without an answer."""
    problem = ""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            response = await client.post(request.url, json=request.body)
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}"
            await _wait_before_retry(attempt, None)
            continue
        if response.status_code in RETRY_STATUSES:
            problem = f"{response.status_code}: {response.text[:300]}"
            await _wait_before_retry(attempt, response)
            continue
        try:
            body: Any = response.json()
        except ValueError:  # not JSON (a proxy's error page): kept as text
            body = response.text
        return response_line(request.custom_id, response.status_code, body)
    raise ServerGone(f"{request.custom_id} got no answer in {MAX_ATTEMPTS} tries (the last: "
                     f"{problem})")


async def _wait_before_retry(attempt: int, response: httpx.Response | None) -> None:
    """The server's Retry-After if it gave one, else exponential backoff; not after the last
    attempt."""
    if attempt == MAX_ATTEMPTS:
        return
    retry_after = response.headers.get("retry-after") if response is not None else None
    try:
        wait = float(retry_after) if retry_after else 2.0 ** attempt
    except ValueError:
        wait = 2.0 ** attempt
    await asyncio.sleep(min(max(wait, 0.1), MAX_RETRY_WAIT_S))
