"""Asyncio front for the engine: a background thread steps it, callers stream per request.

All engine state is touched only by the engine thread; callers hand it commands through a
queue. torch releases the GIL inside its kernels, so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from services.engine.engine import EngineStats, LLMEngine, RequestOutput
from services.engine.sampling_params import SamplingParams


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._stats = engine.stats
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """A snapshot taken after the engine's latest step."""
        return self._stats

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; invalid requests raise here. Closing the stream aborts."""
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, cache_salt,
                                asyncio.get_running_loop(), outputs))
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

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
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
            if self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    if stream is not None:
                        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)
                self._stats = self.engine.stats

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
        else:
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids,
                                        command.params, command.cache_salt)
            except Exception as exc:  # invalid request: hand the error to its caller
                command.loop.call_soon_threadsafe(command.outputs.put_nowait, exc)
                return
            self._streams[command.request_id] = command
        self._stats = self.engine.stats


_NO_COMMAND = object()
