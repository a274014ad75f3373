"""What Ray Serve's streams cost: K per-request streams against one stream carrying K outputs.

    python -m tandem.loadtest.serve_streams [--streams 16] [--ticks 60] [--tick-s 0.05] [--rounds 2]

Why a decode replica hands every request's tokens to a gateway on one channel
(services/serving/decode_channel.py) rather than on one Serve stream per request (as it did
until 2026-12-02), one item per engine step. This starts a private Ray with two deployments, a
producer and a consumer (as the decode replica and the gateway), and times two ways of moving
``streams`` x ``ticks`` outputs, one tick every ``tick_s`` (an engine step):

- ``per-request``: ``streams`` concurrent streams, each yielding one item per tick;
- ``multiplexed``: one stream yielding, per tick, one item holding every request's output;
- ``channel``: Tandem's decode channel itself (``ChannelOutbox`` in the producer,
  ``DecodeChannel`` in the consumer, a unary submit per request), each request's stand-in engine
  stream yielding one ``RequestOutput`` per tick.

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

MODES = ("per-request", "multiplexed", "channel")


@dataclass
class Output:  # the shape of a RequestOutput, small
    request_id: str
    new_token_ids: list[int]
    finished: bool


class TickStream:
    """A decode request's engine stream, standing in: one ``RequestOutput`` per tick."""

    def __init__(self, request_id: str, ticks: int, tick_s: float) -> None:
        self.request_id = request_id
        self._ticks, self._tick_s, self._i = ticks, tick_s, 0

    def __aiter__(self) -> TickStream:
        return self

    async def __anext__(self):  # type: ignore[no-untyped-def]
        from tandem.services.protocol.outputs import FinishReason, RequestOutput

        if self._i == self._ticks:
            raise StopAsyncIteration
        # On a shared clock: every request's output of a step comes at once, as an engine's.
        await asyncio.sleep(self._tick_s - time.monotonic() % self._tick_s)
        self._i += 1
        done = self._i == self._ticks
        return RequestOutput(self.request_id, [self._i], [], done,
                             FinishReason.LENGTH if done else None, 8, self._i, 0)

    async def aclose(self) -> None:
        self._i = self._ticks


def build(ticks: int, tick_s: float):  # type: ignore[no-untyped-def]
    from ray import serve

    from tandem.router import WorkerLoad
    from tandem.services.protocol.messages import WorkerReport
    from tandem.services.serving.decode_channel import ChannelOutbox

    @serve.deployment
    class Producer:
        def __init__(self) -> None:
            self.outboxes: dict[str, ChannelOutbox] = {}

        def report(self) -> WorkerReport:
            return WorkerReport("producer", 1, WorkerLoad(0, 0.0, 0))

        async def channel(self, channel_id: str, route_to: str | None = None
                          ) -> AsyncIterator[list[object]]:
            outbox = self.outboxes[channel_id] = ChannelOutbox(channel_id, self.report)
            try:
                async for batch in outbox.batches():
                    yield batch
            finally:
                del self.outboxes[channel_id]
                await outbox.close()

        async def submit(self, request, channel_id: str,  # type: ignore[no-untyped-def]
                         route_to: str | None = None) -> None:
            await self.outboxes[channel_id].add(TickStream(request.request_id, ticks, tick_s))  # type: ignore[arg-type]

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
            if mode == "channel":
                return await self.channel(streams)
            if mode == "per-request":
                await asyncio.gather(*(one(stream.per_request.remote(f"r{j}"))
                                       for j in range(streams)))
            else:
                await one(stream.multiplexed.remote(streams))
            return outputs, items

        async def channel(self, streams: int) -> tuple[int, int]:
            from tandem.services.protocol.request import GenerationRequest, SamplingParams
            from tandem.services.serving.decode_channel import DecodeChannel

            reports: list[object] = []  # the channel's lists: the hello, then one a tick
            channel = DecodeChannel(self.producer, "producer", reports.append, lambda c: None)
            params = SamplingParams(max_tokens=ticks)

            async def one(j: int) -> int:
                request = GenerationRequest(f"r{j}", [1, 2, 3], params)
                return len([out async for out in channel.generate(request, 60.0)])

            outputs = sum(await asyncio.gather(*(one(j) for j in range(streams))))
            items = channel.lists
            await channel.aclose()
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

        for mode in MODES:  # warm-up
            handle.run.remote(mode, 2).result()
        print(f"{args.streams} streams x {args.ticks} ticks of {1000 * args.tick_s:g} ms "
              f"(the ticks alone: {args.ticks * args.tick_s:.1f} s)")
        print("| round | mode | wall s | items/s | CPU ms per item | CPU ms per output |")
        print("|---|---|---|---|---|---|")
        for round_ in range(args.rounds):
            for mode in MODES:
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
