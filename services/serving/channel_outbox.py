"""A decode replica's side of one decode channel (services/serving/decode_channel.py is the
gateway's): the requests a gateway submitted to it, one pump each moving the request's engine
stream into the channel's queue, and the lists the channel's stream yields.

The first list is a hello (the worker's report). After it, whenever any request produced
output, one list holds everything new: ``RequestOutput``s (each names its request),
``RequestDone`` for each request whose stream ended (its error, if any, as a value), and then
the worker's report in every list that ends a request. Closing the outbox (the channel's stream
ended or was cancelled) aborts every request still on it, freeing its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from tandem.services.protocol.messages import ChannelClosedError, RequestDone, WorkerReport
from tandem.services.protocol.outputs import RequestError, RequestOutput

if TYPE_CHECKING:
    from tandem.services.handoff.decode import DecodeStream

ChannelItem = RequestOutput | RequestDone | WorkerReport


class ChannelOutbox:
    def __init__(self, channel_id: str, report: Callable[[], WorkerReport]) -> None:
        self.channel_id = channel_id
        self._report = report
        self._queue: asyncio.Queue[RequestOutput | RequestDone] = asyncio.Queue()
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    async def batches(self) -> AsyncIterator[list[ChannelItem]]:
        """The channel's lists, the hello first; ends only when cancelled or closed."""
        yield [self._report()]
        while True:
            batch: list[ChannelItem] = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if any(isinstance(item, RequestDone) for item in batch):
                batch.append(self._report())
            yield batch

    async def add(self, stream: DecodeStream) -> None:
        """Start pumping a submitted request's outputs into the channel."""
        if self._closed or stream.request_id in self._pumps:
            await stream.aclose()
            if self._closed:
                raise ChannelClosedError(f"decode channel {self.channel_id} is closed")
            raise RequestError(f"request {stream.request_id!r} is already on this channel")
        self._pumps[stream.request_id] = asyncio.create_task(self._pump(stream))

    async def abort(self, request_id: str) -> None:
        """Stop a request (nothing if it ended): its engine stream closes, its KV is freed."""
        pump = self._pumps.pop(request_id, None)
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def close(self) -> None:
        """Abort every request still on the channel; later submits are refused."""
        self._closed = True
        for request_id in list(self._pumps):
            await self.abort(request_id)

    async def _pump(self, stream: DecodeStream) -> None:
        error: BaseException | None = None
        try:
            async for out in stream:
                self._queue.put_nowait(out)
        except Exception as exc:  # the request's error, e.g. EngineDeadError: the gateway's
            error = exc
        finally:
            await stream.aclose()  # aborts the request unless it finished, frees its blocks
        self._pumps.pop(stream.request_id, None)
        self._queue.put_nowait(RequestDone(stream.request_id, error))
