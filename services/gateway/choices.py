"""Requests with several choices (``n`` > 1, ``best_of``): the prompt is prefilled once.

Choice ``i`` is its own engine request (id ``<id>-<i>``, seed ``seed + i``, as vLLM's rule), so
it equals the same request sent with ``n`` = 1 and that seed, on every path. Choice 0 starts
first; once its first token is out its prompt's full blocks are in its worker's prefix cache
(and, disaggregated, in the router's index, which then sends the others to the same prefill
worker), so the other choices start together and reuse them: each computes only the prompt's
last partial block (fewer than ``block_size`` tokens) and, disaggregated, decode workers pull
only that block. ``tandem_prefix_cache_hits`` shows it.

Each choice counts as a request in the gateway's metrics and in ``max_in_flight``. A choice
that fails fails the whole request: the others are aborted (their blocks freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tandem.services.gateway.core import Gateway, Generation
from tandem.services.gateway.pipeline import Delta, Usage
from tandem.services.gateway.request_trace import RequestTrace
from tandem.services.protocol.request import GenerationRequest

T = TypeVar("T")
_SEED_SPACE = 2**64  # seeds are 64-bit (inputs.py); seed + i wraps within them
_MAX_SEED = 2**64 - 1


def choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice ``index`` of ``request`` (choice 0 is ``request`` itself, and alone computes the
    prompt's logprobs if asked: the same for every choice)."""
    if index == 0:
        return request
    seed = request.params.seed
    if seed is not None:
        seed += index
        if seed > _MAX_SEED:
            seed -= _SEED_SPACE
    params = dataclasses.replace(request.params, seed=seed, prompt_logprobs=None)
    return dataclasses.replace(request, request_id=f"{request.request_id}-{index}",
                               params=params)


async def start_choices(gateway: Gateway, request: GenerationRequest, n: int = 1,
                        trace: RequestTrace | None = None) -> Choices:
    """Start ``n`` choices of ``request``: choice 0 first, then the others at once. If any is
    refused (or this is cancelled), those started are closed and the refusal raised."""
    first = await gateway.start(request, trace)
    if n == 1:
        return Choices([first])
    others = await _all_or_none(
        [gateway.start(choice_request(request, i)) for i in range(1, n)], first.aclose)
    return Choices([first, *others])


async def _all_or_none(work: Sequence[Awaitable[T]], on_failure: Callable[[], Awaitable[None]]
                       ) -> list[T]:
    """Every result of ``work`` (run at once), or, at the first failure (or a cancellation),
    the rest cancelled, ``on_failure`` awaited and the failure raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:
            raise failed
        return [t.result() for t in tasks]
    except BaseException:
        await _cancel(tasks)
        await on_failure()
        raise


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait for them to end; a generation one of them already started is
    closed."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if (not task.cancelled() and task.exception() is None
                and isinstance(task.result(), Generation)):
            await task.result().aclose()


@dataclass
class Choices:
    """A started request's choices (one or more ``Generation``s). Close it to abort those
    unfinished."""

    generations: list[Generation]

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        """Each choice's deltas as they come, with its index. A choice's failure is raised; the
        other choices are closed when the stream is."""
        streams = [aiter(g) for g in self.generations]
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    index = pending.pop(task)
                    try:
                        delta = task.result()
                    except StopAsyncIteration:
                        continue
                    yield index, delta
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
        finally:
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
            for stream in streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            await self.aclose()

    async def collect(self) -> list[Delta]:
        """Every choice run to its end, each merged into one delta (``Generation.collect``);
        the first failure ends them all."""
        return await _all_or_none([g.collect() for g in self.generations], self.aclose)

    async def aclose(self) -> None:
        """Close every choice (aborting those unfinished), even if one close fails."""
        results = await asyncio.gather(*(g.aclose() for g in self.generations),
                                       return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    async def cut_slow_client(self, read_timeout_s: float) -> None:
        """The client stopped reading: counted and logged once (on choice 0), every choice
        aborted."""
        await self.generations[0].cut_slow_client(read_timeout_s)
        await self.aclose()


def total_usage(usages: Sequence[Usage | None]) -> Usage | None:
    """The usage of a request with several choices: its prompt once (as choice 0 saw it) and
    every choice's completion tokens."""
    if not usages or usages[0] is None:
        return None
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages if u is not None)
    return Usage(first.prompt_tokens, completion, first.cached_tokens)


def cumulative_logprob(delta: Delta) -> float:
    """The sum of the log-probabilities of a choice's tokens (what ``best_of`` ranks by)."""
    return sum(lp.logprob for lp in delta.logprobs)
