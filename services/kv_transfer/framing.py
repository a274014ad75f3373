"""Length-prefixed frames: a 4-byte big-endian length, then a UTF-8 JSON object.

Raw KV bytes, when a frame announces them (``nbytes``), follow it on the same stream. Peers
only ever send JSON objects and raw bytes; nothing received is unpickled or evaluated.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Mapping
from typing import Any

_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20


class FrameError(ValueError):
    """The peer sent something that is not a valid frame."""


def encode_frame(header: Mapping[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return _LENGTH.pack(len(body)) + body


def decode_header(body: bytes) -> dict[str, Any]:
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError(f"frame must be a JSON object, got {type(header).__name__}")
    return header


def _check_length(prefix: bytes) -> int:
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise FrameError(f"frame announces {length} bytes; the limit is {MAX_HEADER_BYTES}")
    return length


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame from a stream, or None at a clean end of stream."""
    try:
        prefix = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("stream ended inside a frame length") from None
    body = await reader.readexactly(_check_length(prefix))
    return decode_header(body)


async def sock_recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                         view: memoryview) -> None:
    """Fill ``view`` from a non-blocking socket."""
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-message")
        view = view[n:]


async def sock_read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket
                          ) -> dict[str, Any] | None:
    """The next frame from a non-blocking socket, or None at a clean end of stream."""
    prefix = bytearray(_LENGTH.size)
    n = await loop.sock_recv_into(sock, prefix)
    if n == 0:
        return None
    await sock_recv_into(loop, sock, memoryview(prefix)[n:])
    body = bytearray(_check_length(bytes(prefix)))
    await sock_recv_into(loop, sock, memoryview(body))
    return decode_header(bytes(body))
