"""The gateway's side of a decode channel: one Serve stream per (gateway, decode replica),
carrying the outputs of every request the gateway has on that replica.

Ray Serve delivers a limited number of spaced stream items a second in all (~75, however many
streams; docs/loadtest.md "Serve's per-request streams"), so a stream per request bunches the
tokens of concurrent requests. Instead the gateway opens one channel per decode worker
(``DecodeReplica.channel``, on the first request routed there), submits each request to it
(``DecodeReplica.submit``, unary), and a reader task hands each list the replica yields to the
requests it names: ``RequestOutput``s, ``RequestDone`` (a request's end, or its error), after
ingesting the list's ``WorkerReport``s. ``DecodeReplica.abort`` stops one request (its KV
freed); ending the channel's stream aborts every request still on it.

A channel that fails (the replica died, the stream ended, no hello within the timeout, silence
for ``idle_s`` while requests wait on it) fails every request on it with that error and is
dropped; the next request routed to the worker opens a new one. Each request also has its own
idle timer, so a request that gets nothing for ``idle_s`` ends with ``StreamStalledError``.

The gateway's calls to worker replicas through Serve handles, with the replicas' errors as
our own: a replica's exception arrives wrapped in ``RayTaskError``, a dead replica as
``RayActorError``; these give the caller the plain error (``ReplicaGoneError`` for a dead one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from tandem.services.protocol.messages import (
    ChannelClosedError,
    ReplicaGoneError,
    RequestDone,
    WorkerReport,
)
from tandem.services.protocol.outputs import (
    DeadlineExceededError,
    DecodeRejectedError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestError,
    RequestOutput,
    UnavailableError,
)
from tandem.services.protocol.request import GenerationRequest

if TYPE_CHECKING:
    from tandem.services.handoff.decode import DecodeStream



log = logging.getLogger(__name__)

Delivery = RequestOutput | RequestDone | BaseException  # what a request's queue holds


class StreamStalledError(DeadlineExceededError):
    """A decode worker sent nothing for ``stream_idle_s``."""


class DecodeChannel:
    """One decode worker's channel: opened at construction (its hello awaited by the first
    request), closed on failure or by ``close``."""

    def __init__(self, decode: DeploymentHandle, worker_id: str,
                 ingest: Callable[[WorkerReport], None],
                 on_close: Callable[[DecodeChannel], None]) -> None:
        self.worker_id = worker_id
        self.channel_id = uuid.uuid4().hex
        self.failure: BaseException | None = None
        self.lists = 0  # received from the replica, the hello included
        self._decode = decode
        self._ingest = ingest
        self._on_close = on_close
        self._queues: dict[str, asyncio.Queue[Delivery]] = {}
        self._hello = asyncio.get_running_loop().create_future()
        self._heard = time.monotonic()  # when the replica last sent a list
        self._background: set[asyncio.Task[Any]] = set()
        self._response = decode.options(stream=True).channel.remote(self.channel_id,
                                                                    route_to=worker_id)
        self._reader = asyncio.create_task(self._read())

    async def generate(self, request: GenerationRequest, idle_s: float
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs from this worker. The hello, the submit and every gap between
        outputs are bounded by ``idle_s``. Closed early (the client left, or an error), the
        request is aborted on the replica."""
        request_id = request.request_id
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._queues[request_id] = queue
        ended = False  # nothing left on the replica to abort
        try:
            await self._opened(idle_s)
            try:
                async with asyncio.timeout(idle_s):
                    await call(self._decode.submit.remote(request, self.channel_id,
                                                          route_to=self.worker_id))
            except TimeoutError:
                raise self._stalled(idle_s, "did not take the request") from None
            except ChannelClosedError as exc:
                ended = True
                self.close(exc)
                raise
            except Exception:
                ended = True  # the replica refused it: nothing is running there
                raise
            while True:
                item = await self._next(queue, idle_s)
                if isinstance(item, BaseException):  # the channel failed: the replica aborts
                    ended = True
                    raise item
                if isinstance(item, RequestDone):
                    ended = True
                    if item.error is not None:
                        raise clean_error(item.error)
                    return
                ended = item.finished
                yield item
        finally:
            del self._queues[request_id]
            if not ended and self.failure is None:
                self._abort_later(request_id)

    @property
    def idle(self) -> bool:
        """No request is on the channel."""
        return not self._queues

    def close(self, error: BaseException) -> None:
        """Fail every request on the channel with ``error`` and end its stream (the replica
        then aborts whatever of them it still runs)."""
        if self.failure is None:
            self.failure = error
            for queue in self._queues.values():
                queue.put_nowait(error)
            if not self._hello.done():
                self._hello.set_result(None)
            self._on_close(self)
        self._response.cancel()
        if self._reader is not asyncio.current_task():
            self._reader.cancel()

    async def _opened(self, timeout_s: float) -> None:
        if not self._hello.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(self._hello)
            except TimeoutError:
                self.close(self._stalled(timeout_s, "did not open a channel"))
        if self.failure is not None:
            raise self.failure

    async def _next(self, queue: asyncio.Queue[Delivery], idle_s: float) -> Delivery:
        try:
            async with asyncio.timeout(idle_s):
                return await queue.get()
        except TimeoutError:
            stalled = self._stalled(idle_s, "sent nothing")
            if time.monotonic() - self._heard >= idle_s:  # the whole channel is silent
                self.close(stalled)
            raise stalled from None

    def _stalled(self, idle_s: float, what: str) -> StreamStalledError:
        return StreamStalledError(f"decode worker {self.worker_id} {what} for {idle_s:.0f} s")

    async def _read(self) -> None:
        error: BaseException = ReplicaGoneError(
            f"decode worker {self.worker_id} closed its channel")
        try:
            async for batch in stream_items(self._response):
                self._dispatch(batch)
        except asyncio.CancelledError:
            return  # closed
        except Exception as exc:
            error = exc
        self.close(error)

    def _dispatch(self, batch: list[RequestOutput | RequestDone | WorkerReport]) -> None:
        self._heard = time.monotonic()
        self.lists += 1
        # Reports first: a request's caller stops reading at its finished output, and the list
        # that ends a request carries the worker's report (its load and KV events).
        for item in batch:
            if isinstance(item, WorkerReport):
                self._ingest(item)
        if not self._hello.done():
            self._hello.set_result(None)
        for item in batch:
            if isinstance(item, RequestOutput | RequestDone):
                queue = self._queues.get(item.request_id)
                if queue is not None:
                    queue.put_nowait(item)

    def _abort_later(self, request_id: str) -> None:
        async def abort() -> None:
            try:
                await call(self._decode.abort.remote(self.channel_id, request_id,
                                                     route_to=self.worker_id))
            except Exception as exc:  # the replica is gone: so is the request
                log.warning("request %s: abort on decode worker %s failed: %r", request_id,
                            self.worker_id, exc)

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        """Close (requests on it fail) and wait for the pending aborts."""
        self.close(ReplicaGoneError("the gateway is closing"))
        for task in list(self._background):
            await asyncio.gather(task, return_exceptions=True)


# -- The decode replica's side: ChannelOutbox --------------------------------------------------
# A decode replica's side of one decode channel (services/serving/decode_channel.py is the
# gateway's): the requests a gateway submitted to it, one pump each moving the request's engine
# stream into the channel's queue, and the lists the channel's stream yields. The first list is
# a hello (the worker's report). After it, whenever any request produced output, one list holds
# everything new: ``RequestOutput``s (each names its request), ``RequestDone`` for each request
# whose stream ended (its error, if any, as a value), and then the worker's report in every list
# that ends a request. Closing the outbox (the channel's stream ended or was cancelled) aborts
# every request still on it, freeing its KV.


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


def clean_error(exc: BaseException) -> BaseException:
    """A replica's error (wrapped in RayTaskError, or a plain one that came as a value) as the
    gateway handles it."""
    if isinstance(exc, RayActorError):  # the replica's process died during the call
        return ReplicaGoneError("the worker's replica died during the call")
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, ReplicaGoneError):  # ChannelClosedError stays one
        return type(cause)(str(cause))
    if isinstance(cause, RequestError):
        return RequestError(str(cause))
    for kind in (EngineDeadError, EngineError, DeadlineExceededError, UnavailableError):
        if isinstance(cause, kind):  # the most specific first: EngineDeadError is an EngineError
            return kind(str(cause))
    if isinstance(cause, EngineOverloadedError | DecodeRejectedError):
        return EngineOverloadedError(str(cause))
    return exc


async def call(response: Any) -> Any:
    """A unary call's result; cancelling the caller cancels the call."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
    except Exception as exc:
        cleaned = clean_error(exc)
        if cleaned is exc:
            raise
        raise cleaned from None


async def stream_items(stream: Any) -> AsyncIterator[Any]:
    """A streaming call's items."""
    try:
        async for item in stream:
            yield item
    except Exception as exc:
        cleaned = clean_error(exc)
        if cleaned is exc:
            raise
        raise cleaned from None
