"""Drive one workload against one client at one load, within a deadline."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from tandem.loadtest.bench.arrivals import Load, arrival_offsets
from tandem.loadtest.bench.clients import Client
from tandem.loadtest.bench.server_metrics import RoleCounters
from tandem.loadtest.bench.workloads import BenchRequest
from tandem.services.protocol.bench_records import CUT_OFF, RequestRecord


@dataclass
class RunResult:
    """One pass of a workload against one target at one load."""

    label: str
    load: Load
    round: int
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    not_sent: int = 0  # requests the deadline left unsent
    deadline_hit: bool = False
    # The server's prefix-cache counters over the run, per worker role (--server-metrics).
    server_cache: RoleCounters | None = None


async def run_workload(client: Client, requests: list[BenchRequest], load: Load, *,
                       label: str, round_: int = 0, deadline_s: float = 600.0,
                       arrival_seed: int = 0, progress: bool = True) -> RunResult:
    """Send ``requests`` at ``load``; stop sending and cut off what is in flight at the
    deadline. A request with ``after`` set is sent only once that request has finished."""
    finished = {r.index: asyncio.Event() for r in requests}
    records: dict[int, RequestRecord] = {}
    started: dict[int, float] = {}
    bar = tqdm(total=len(requests), desc=f"{label} @ {load.label}", unit="req",
               disable=not progress, leave=False)
    origin = time.perf_counter()

    async def send(request: BenchRequest) -> None:
        if request.after is not None:
            await finished[request.after].wait()
        started[request.index] = time.perf_counter() - origin
        try:
            records[request.index] = await client.send(request, origin)
        finally:
            finished[request.index].set()
            bar.update(1)

    async def at_rate() -> None:
        offsets = arrival_offsets(len(requests), load, np.random.default_rng(arrival_seed))
        tasks: list[asyncio.Task[None]] = []
        try:
            for request, offset in zip(requests, offsets, strict=True):
                delay = origin + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(request)))
            await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)

    async def at_concurrency() -> None:
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue:
                await send(queue.pop())

        workers = [asyncio.create_task(worker()) for _ in range(int(load.value))]
        try:
            await asyncio.gather(*workers)
        finally:
            await _cancel(workers)

    deadline_hit = False
    try:
        async with asyncio.timeout(deadline_s):
            await (at_rate() if load.mode == "rate" else at_concurrency())
    except TimeoutError:
        deadline_hit = True
    finally:
        bar.close()
    duration = time.perf_counter() - origin
    by_index = {r.index: r for r in requests}
    for index, start in started.items():
        if index not in records:  # in flight at the deadline
            r = by_index[index]
            records[index] = RequestRecord(index, r.kind, r.group, r.prompt_tokens, start,
                                           error=CUT_OFF)
    return RunResult(label, load, round_, duration,
                     records=[records[i] for i in sorted(records)],
                     not_sent=len(requests) - len(started), deadline_hit=deadline_hit)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel what is still running (the deadline, or a failure elsewhere) and let it unwind."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
