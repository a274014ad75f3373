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

from tandem.services.batch.batch_file import BatchRequest, error_line, response_line

# Answers that mean "not now" (the server is full, or a worker is being replaced): the
# request is sent again after the server's Retry-After, up to NOT_NOW_ATTEMPTS tries.
NOT_NOW_STATUSES = frozenset({429, 503})
NOT_NOW_ATTEMPTS = 10
# Another 5xx, a timeout or a lost connection: the server failed, not the request; tried
# FAULT_ATTEMPTS times, backing off 1, 2, 4 s (or after the server's Retry-After).
FAULT_ATTEMPTS = 4
MAX_RETRY_WAIT_S = 30.0
# Requests in a row that got no answer after their tries (an error line each): the server is
# gone, the run stops rather than write an error line for every request left.
STOP_AFTER_ERRORS = 10


class ServerUnusable(ValueError):
    """Before any request: the server does not answer, or refuses the API key (the CLI's
    usage error, exit 2)."""


class ServerGone(RuntimeError):
    """``STOP_AFTER_ERRORS`` requests in a row got no answer: the run stops; the requests
    without an output line are sent by the next run (those with an error line too, with
    ``--retry-failed``)."""


@dataclass
class Summary:
    """What one run did (requests already answered by an earlier run not counted)."""

    requests: int = 0
    failed: int = 0  # answered with a status other than 200, or not answered (errors)
    errors: int = 0  # not answered after their tries: an error line, --retry-failed resends
    errors_in_a_row: int = 0  # the error lines since the last answer
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    def add(self, line: dict[str, Any]) -> None:
        self.requests += 1
        error = line["error"] is not None
        self.errors += error
        self.errors_in_a_row = self.errors_in_a_row + 1 if error else 0
        if error or line["response"]["status_code"] != 200:
            self.failed += 1
            return
        body = line["response"]["body"]
        usage = (body.get("usage") if isinstance(body, dict) else None) or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        errors = f", {self.errors} without an answer" if self.errors else ""
        return (f"{self.requests} requests ({self.failed} failed{errors}), "
                f"{self.prompt_tokens} prompt ({self.cached_tokens} cached) + "
                f"{self.completion_tokens} completion tokens in "
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
    base URL is the server's, without ``/v1``); ``write`` each request's line as it comes
    (so in the order they finish). ``ServerGone`` after ``STOP_AFTER_ERRORS`` error lines in
    a row."""
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
            if summary.errors_in_a_row >= STOP_AFTER_ERRORS:
                raise ServerGone(f"{summary.errors_in_a_row} requests in a row got no answer "
                                 f"(the last: {line['error']['message']})")

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
    """The output line of one request: the server's answer (a 200, or a 4xx: the request is
    wrong, final at once), after retries of "not now" (429, 503: ``NOT_NOW_ATTEMPTS`` tries)
    and of server faults (another 5xx, a timeout, a lost connection: ``FAULT_ATTEMPTS``); or,
    when the tries are spent, an error line recording the last."""
    not_now = faults = 0
    while True:
        outcome: httpx.Response | httpx.TransportError
        try:
            outcome = await client.post(request.url, json=request.body)
        except httpx.TransportError as exc:
            outcome = exc
        if isinstance(outcome, httpx.Response) and outcome.status_code in NOT_NOW_STATUSES:
            not_now += 1
            spent = not_now == NOT_NOW_ATTEMPTS
        elif isinstance(outcome, httpx.TransportError) or outcome.status_code >= 500:
            faults += 1
            spent = faults == FAULT_ATTEMPTS
        else:  # a 200, or a 4xx: the request itself is wrong, sending it again changes nothing
            return response_line(request.custom_id, outcome.status_code, _body(outcome))
        if spent:
            return _error_line(request.custom_id, outcome, not_now + faults)
        await _wait_before_retry(not_now + faults, outcome)


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:  # not JSON (a proxy's error page): kept as text
        return response.text


def _error_line(custom_id: str, outcome: httpx.Response | httpx.TransportError,
                tries: int) -> dict[str, Any]:
    if isinstance(outcome, httpx.TransportError):
        code = "timeout" if isinstance(outcome, httpx.TimeoutException) else "connection_error"
        return error_line(custom_id, code, f"{type(outcome).__name__}: {outcome} (after "
                                           f"{tries} tries)")
    status = outcome.status_code
    return error_line(custom_id, "rate_limit_exceeded" if status == 429 else "server_error",
                      f"HTTP {status}: {outcome.text[:300]} (after {tries} tries)", status,
                      _body(outcome))


async def _wait_before_retry(tries: int, outcome: httpx.Response | httpx.TransportError
                             ) -> None:
    """The server's Retry-After if it gave one, else backing off: 1 s after the first try,
    doubling after each; MAX_RETRY_WAIT_S at most."""
    retry_after = (outcome.headers.get("retry-after")
                   if isinstance(outcome, httpx.Response) else None)
    try:
        wait = float(retry_after) if retry_after else 2.0 ** (tries - 1)
    except ValueError:
        wait = 2.0 ** (tries - 1)
    await asyncio.sleep(min(max(wait, 0.1), MAX_RETRY_WAIT_S))
