"""The gateway's calls to worker replicas through Serve handles, with the replicas' errors as
our own: a replica's exception arrives wrapped in ``RayTaskError``, a dead replica as
``RayActorError``; these give the caller the plain error (``ReplicaGoneError`` for a dead one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from tandem.services.protocol.messages import ReplicaGoneError
from tandem.services.protocol.outputs import (
    DeadlineExceededError,
    DecodeRejectedError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    RequestError,
    UnavailableError,
)


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
