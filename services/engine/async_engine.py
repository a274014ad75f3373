"""Asyncio front for the engine: a background thread steps it, callers stream per request.

All engine state is touched only by the engine thread; callers hand it commands through a
queue (``call`` runs any function on that thread, e.g. the KV import hooks of a decode worker).
torch releases the GIL inside its kernels, so the event loop stays responsive.

KV events leave the engine thread only through the ``on_events`` callback, one batch per step
or command that produced any; without a callback they are dropped.

Faults: a step that raises fails that step's requests (``EngineError``, blocks freed) and the
engine goes on. A fault it cannot recover from (a device error, or ``MAX_STEP_FAILURES`` failed
steps in a row) stops it: every request fails with ``EngineDeadError``, new ones are refused,
and ``check_health`` raises, so Ray Serve replaces the worker. A step that never returns (a
hung kernel or device) is caught by ``check_health`` once it has run ``step_timeout_s``
(EngineConfig): the same, from the caller's thread, as the engine thread is stuck. Each fault
is logged once, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.services.engine.faults import FatalEngineFault
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.sequence import SequenceFault
from tandem.services.engine.tensor_parallel import TensorParallelError
from tandem.services.protocol.kv_events import KVEvent
from tandem.services.protocol.outputs import (
    EngineDeadError,
    EngineError,
    EngineStats,
    RequestOutput,
)
from tandem.services.protocol.request import GenerationRequest

T = TypeVar("T")

log = logging.getLogger(__name__)

# This many failed steps in a row stop the engine: the fault is not one request's.
MAX_STEP_FAILURES = 3
# Errors that leave the device (and so the engine) in an unknown state.
_FATAL: tuple[type[BaseException], ...] = (FatalEngineFault, MemoryError, TensorParallelError,
                                           *((torch.AcceleratorError,)
                                             if hasattr(torch, "AcceleratorError") else ()))


@dataclass
class _Start:
    """Create a request with ``start`` and stream its outputs."""

    request_id: str
    start: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine,
                 on_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        """``on_events`` gets the engine's KV events, in order, after each step (before that
        step's outputs reach their streams) and after each command that queued some. It runs
        on the engine thread: it must be cheap and must not block (no network, no encoding;
        append to a buffer that another thread publishes). What it raises is logged."""
        self.llm = engine
        self._on_events = on_events
        self._commands: queue.SimpleQueue[_Start | _Call | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Start] = {}
        self._stats = engine.stats
        self._step_failures = 0  # in a row
        self.health_error: str | None = None  # why the engine stopped; None while it runs
        self._step_timeout_s = engine.config.step_timeout_s
        self._step_started: float | None = None  # monotonic; None between steps
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """A snapshot taken after the engine's latest step."""
        return self._stats

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine stopped or a step has hung (Ray Serve's
        health check)."""
        self._check_step_time()
        if self.health_error is None and not self._thread.is_alive():
            self.health_error = "the engine thread has stopped"
        if self.health_error is not None:
            raise EngineDeadError(f"the engine stopped: {self.health_error}")

    @property
    def healthy(self) -> bool:
        self._check_step_time()
        return self.health_error is None and self._thread.is_alive()

    def _check_step_time(self) -> None:
        """A step running past ``step_timeout_s`` is a hung engine: fail its streams now (the
        engine thread cannot), refuse new requests. Should the step ever return, the engine
        thread stops there (``_loop``) and frees what it holds."""
        started, limit = self._step_started, self._step_timeout_s
        if self.health_error is not None or started is None or limit is None:
            return
        elapsed = time.monotonic() - started
        if elapsed <= limit:
            return
        self.stop(f"a step has run for {elapsed:.0f} s (step_timeout_s {limit:g}): the engine "
                  f"is hung")

    def stop(self, reason: str) -> None:
        """Stop for good from outside the engine thread (a hung step; a KV transfer into the
        cache that could not be stopped): fail its streams now, refuse new requests and fail
        the health check; the engine thread stops after its current step, if any."""
        if self.health_error is not None:
            return
        self.health_error = reason
        log.error("%s; failing its requests", reason)
        error = EngineDeadError(f"the engine stopped: {reason}")
        for stream in list(self._streams.values()):  # one C-level copy: no race with it
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)

    def _refuse_if_dead(self) -> None:
        if self.health_error is not None:
            raise EngineDeadError(f"the engine stopped: {self.health_error}")

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. The request is queued on the first iteration, where an
        invalid one raises. Closing the stream early aborts the request."""
        return self._outputs(request.request_id, lambda engine: engine.add_request(request))

    def stream(self, request_id: str, start: Callable[[LLMEngine], object]
               ) -> AsyncIterator[RequestOutput]:
        """Run ``start`` on the engine thread now, not on the first iteration (it creates
        request ``request_id``, e.g. by committing a KV import), and stream that request's
        outputs; what ``start`` raises comes out of the first iteration."""
        self._refuse_if_dead()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._commands.put(_Start(request_id, start, asyncio.get_running_loop(), outputs))
        return self._outputs(request_id, None, outputs)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        self._refuse_if_dead()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put(_Call(fn, loop, future))
        return await future

    async def _outputs(self, request_id: str, start: Callable[[LLMEngine], object] | None,
                       outputs: asyncio.Queue[RequestOutput | BaseException] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        if outputs is None:  # not started yet
            assert start is not None
            self._refuse_if_dead()
            outputs = asyncio.Queue()
            self._commands.put(_Start(request_id, start, asyncio.get_running_loop(), outputs))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)
        self.llm.close()

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop itself: never die silently
            log.exception("the engine loop failed")
            self._die(f"the engine loop failed: {exc!r}")
            self._serve_dead()

    def _loop(self) -> None:
        while True:
            idle = not self.llm.has_unfinished_requests()
            try:
                command = self._commands.get(block=idle)
            except queue.Empty:
                command = _NO_COMMAND
            while command is not _NO_COMMAND:
                if command is None:
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = _NO_COMMAND
            if self.llm.has_unfinished_requests():
                self._step_started = time.monotonic()
                try:
                    outputs: Sequence[RequestOutput] | None = self.llm.step()
                except Exception as exc:
                    outputs = None
                    if self._step_failed(exc):
                        self._serve_dead()
                        return
                finally:
                    self._step_started = None
                if self.health_error is not None:  # stopped from outside (``stop``)
                    self._die(self.health_error)
                    self._serve_dead()
                    return
                if outputs is None:
                    continue
                self._step_failures = 0
                self._stats = self.llm.stats
                self._hand_out_events()
                self._hand_out(outputs)

    def _hand_out(self, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs to their streams: one wake-up of each event loop per step, not
        one per output (each is a write to the loop's self-pipe and a turn of it, which at
        batch 32 costs the loop's thread more than the outputs themselves)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Start, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, delivered in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, delivered)
            except RuntimeError:  # that event loop has closed: no one reads these streams
                for stream, _ in delivered:
                    self._streams.pop(stream.request_id, None)
                    self.llm.abort_request(stream.request_id)

    def _apply(self, command: _Start | _Call | _Abort) -> None:
        if isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.llm.abort_request(command.request_id)
        elif isinstance(command, _Call):
            result: Any = None
            error: Exception | None = None
            try:
                result = command.fn(self.llm)
            except Exception as exc:
                error = exc
            self._hand_out_events()  # before the caller hears back, as for step outputs
            with contextlib.suppress(RuntimeError):  # its event loop has closed
                command.loop.call_soon_threadsafe(_resolve, command.future, result, error)
        else:
            try:
                command.start(self.llm)
            except Exception as exc:  # invalid request: hand the error to its caller
                with contextlib.suppress(RuntimeError):  # its event loop has closed
                    command.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
                return
            self._hand_out_events()
            self._streams[command.request_id] = command
        self._stats = self.llm.stats

    def _step_failed(self, exc: Exception) -> bool:
        """Fail the step's requests (only the one a ``SequenceFault`` names); True when the
        engine must stop instead."""
        if isinstance(exc, SequenceFault):
            failed = self.llm.fail_step(only=exc.request_id)
            log.error("engine step failed in request %s; failing it, the step's others run "
                      "on", exc.request_id, exc_info=exc)
            for request_id in failed:
                self._fail(request_id, EngineError(
                    f"the engine failed while running request {request_id}: {exc}"))
            self._stats = self.llm.stats
            self._hand_out_events()
            return False
        self._step_failures += 1
        fatal = isinstance(exc, _FATAL) or self._step_failures >= MAX_STEP_FAILURES
        if fatal:
            log.error("engine step failed (%d in a row); stopping the engine", self._step_failures,
                      exc_info=exc)
            self._die(f"{exc!r} (after {self._step_failures} failed step(s) in a row)")
            return True
        try:
            failed = self.llm.fail_step()
        except Exception as cleanup:
            log.error("engine step failed and its requests could not be freed; stopping",
                      exc_info=cleanup)
            self._die(f"{exc!r}, then freeing its requests failed: {cleanup!r}")
            return True
        log.error("engine step failed; failing its %d request(s): %s", len(failed),
                  ", ".join(failed), exc_info=exc)
        for request_id in failed:
            self._fail(request_id, EngineError(
                f"the engine failed while running request {request_id}: {exc}"))
        self._stats = self.llm.stats
        self._hand_out_events()
        return False

    def _die(self, reason: str) -> None:
        """Stop for good: fail every stream, free what can be freed, refuse what comes."""
        self.health_error = reason
        for request_id in list(self._streams):
            self._fail(request_id, EngineDeadError(f"the engine stopped: {reason}"))
        for request_id in list(self.llm.requests):
            try:
                self.llm.abort_request(request_id)
            except Exception:  # the engine is broken; the replica is replaced anyway
                break
        with contextlib.suppress(Exception):
            self._stats = self.llm.stats

    def _serve_dead(self) -> None:
        """Answer commands with ``EngineDeadError`` until shutdown."""
        error = f"the engine stopped: {self.health_error}"
        while (command := self._commands.get()) is not None:
            if isinstance(command, _Call):
                command.loop.call_soon_threadsafe(_resolve, command.future, None,
                                                  EngineDeadError(error))
            elif isinstance(command, _Start):
                command.loop.call_soon_threadsafe(command.outputs.put_nowait,
                                                  EngineDeadError(error))

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: no one to tell
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)

    def _hand_out_events(self) -> None:
        events = self.llm.take_events()
        if not events or self._on_events is None:
            return
        try:
            self._on_events(events)
        except Exception:  # never let a consumer's bug stop the engine thread
            log.exception("on_events raised; %d KV events lost", len(events))


def _deliver(delivered: list[tuple[_Start, RequestOutput]]) -> None:
    for stream, out in delivered:
        stream.outputs.put_nowait(out)


def _resolve(future: asyncio.Future[Any], result: object, exc: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


_NO_COMMAND = object()
