"""What Ray Serve's streams cost: K per-request streams against one stream carrying K outputs.

    python -m loadtest.serve_streams [--streams 16] [--ticks 60] [--tick-s 0.05] [--rounds 2]

Why a decode replica hands every request's tokens to a gateway on one channel
(services/serving/decode_channel.py) rather than on one Serve stream per request (as it did
until 2026-12-02), one item per engine step. This starts a private Ray with two deployments, a
producer and a consumer (as the decode replica and the gateway), and times two ways of moving
``streams`` x ``ticks`` outputs, one tick every ``tick_s`` (an engine step):

- ``per-request``: ``streams`` concurrent streams, each yielding one item per tick;
- ``multiplexed``: one stream yielding, per tick, one item holding every request's output.

For each: wall time (the ticks alone take ``ticks`` x ``tick_s``), stream items per second, and
the CPU seconds of the two replica processes per item and per output. Interleaved rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psutil


@dataclass
class Output:  # the shape of a RequestOutput, small
    request_id: str
    new_token_ids: list[int]
    finished: bool


def build(ticks: int, tick_s: float):  # type: ignore[no-untyped-def]
    from ray import serve

    @serve.deployment
    class Producer:
        async def per_request(self, request_id: str) -> AsyncIterator[list[Output]]:
            for i in range(ticks):
                await asyncio.sleep(tick_s)
                yield [Output(request_id, [i], i == ticks - 1)]

        async def multiplexed(self, streams: int) -> AsyncIterator[list[Output]]:
            for i in range(ticks):
                await asyncio.sleep(tick_s)
                yield [Output(f"r{j}", [i], i == ticks - 1) for j in range(streams)]

        def pid(self) -> int:
            return os.getpid()

    @serve.deployment
    class Consumer:
        def __init__(self, producer) -> None:  # type: ignore[no-untyped-def]
            self.producer = producer

        async def run(self, mode: str, streams: int) -> tuple[int, int]:
            """(outputs received, stream items received)."""
            outputs = items = 0

            async def one(source) -> None:  # type: ignore[no-untyped-def]
                nonlocal outputs, items
                async for batch in source:
                    outputs += len(batch)
                    items += 1

            stream = self.producer.options(stream=True)
            if mode == "per-request":
                await asyncio.gather(*(one(stream.per_request.remote(f"r{j}"))
                                       for j in range(streams)))
            else:
                await one(stream.multiplexed.remote(streams))
            return outputs, items

        async def pids(self) -> list[int]:
            return [os.getpid(), await self.producer.pid.remote()]

    return Consumer.bind(Producer.bind())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--tick-s", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")  # the table only
    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")
    try:
        handle = serve.run(build(args.ticks, args.tick_s), name="serve-streams")
        processes = [psutil.Process(pid) for pid in handle.pids.remote().result()]

        def cpu() -> float:
            return sum(p.cpu_times().user + p.cpu_times().system for p in processes)

        for mode in ("per-request", "multiplexed"):  # warm-up
            handle.run.remote(mode, 2).result()
        print(f"{args.streams} streams x {args.ticks} ticks of {1000 * args.tick_s:g} ms "
              f"(the ticks alone: {args.ticks * args.tick_s:.1f} s)")
        print("| round | mode | wall s | items/s | CPU ms per item | CPU ms per output |")
        print("|---|---|---|---|---|---|")
        for round_ in range(args.rounds):
            for mode in ("per-request", "multiplexed"):
                cpu0, began = cpu(), time.monotonic()
                outputs, items = handle.run.remote(mode, args.streams).result()
                wall, used = time.monotonic() - began, cpu() - cpu0
                print(f"| {round_} | {mode} | {wall:.1f} | {items / wall:.0f} | "
                      f"{1000 * used / items:.2f} | {1000 * used / outputs:.2f} |", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
