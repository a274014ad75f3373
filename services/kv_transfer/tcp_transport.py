"""Plain TCP transport, for machines where NIXL cannot load.

Every worker serves reads of its own cache; a reader sends ``{"op": "read", "lease": ...,
"reader": <its worker id>, "blocks": [...]}`` and gets ``{"ok": true, "nbytes": N}`` followed
by the blocks' raw bytes in request order (or ``{"ok": false, "error": ...}``: among others for
a read that no live lease of this worker offered to that reader covers, ``reads_allowed``).
With a cluster key each connection starts with the cluster handshake (services/protocol/handoff.py),
which proves the reader's name; a connection that fails it is closed before any read.

With ``tls`` (``InternalTLS``: the ``internal_tls_*`` settings) every connection is mutual TLS
1.3 under the cluster's CA before the handshake; both sides must have it (a worker's pairing
metadata says whether it serves TLS, and a mismatch is an error naming the settings).

Bytes go straight between the socket and a host cache (over TLS, through the stream's
buffers); a GPU cache is staged through host memory (the blocks gathered and copied out before
sending, received into a host buffer and copied in), which is how ``auto`` moves GPU KV where
NIXL cannot. Those copies run in the transport's copy threads, not on the event loop: a copy of
many MB would stall every other connection's I/O meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

from tandem.services.kv_transfer.framing import (
    FrameError,
    encode_frame,
    read_frame,
    sock_read_frame,
    sock_recv_into,
)
from tandem.services.kv_transfer.transport import KVTransferError, KVTransport, TransferFaults
from tandem.services.protocol import handoff
from tandem.services.protocol.handoff import ClusterKey
from tandem.services.tls import InternalTLS

log = logging.getLogger(__name__)

MAX_BLOCKS_PER_READ = 1 << 16
TLS_HANDSHAKE_TIMEOUT_S = 10.0
TLS_SETTINGS = "internal_tls_cert_file, internal_tls_key_file and internal_tls_ca_file"

T = TypeVar("T")


class TcpTransport(KVTransport):
    kind = "tcp"

    def __init__(self, name: str, faults: TransferFaults | None = None,
                 host: str = "127.0.0.1", port: int = 0, staged: bool | None = None,
                 key: ClusterKey | None = None, tls: InternalTLS | None = None) -> None:
        super().__init__(name, faults, key)
        self.tls = tls
        self._server_tls = tls.server_context() if tls is not None else None
        self._client_tls = tls.client_context() if tls is not None else None
        self.host = host
        self.port = port
        self.staged = staged  # through host buffers; None: when the cache is not in host memory
        self._server: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._addresses: dict[str, tuple[str, int]] = {}
        self._idle: dict[str, list[_Connection]] = {}
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-tcp-copy")

    # -- serving --------------------------------------------------------------------------

    async def _start(self, kv_cache: torch.Tensor) -> None:
        if self.staged is None:
            self.staged = kv_cache.device.type != "cpu"
        server = socket.create_server((self.host, self.port))
        server.setblocking(False)
        self._server = server
        self.port = server.getsockname()[1]
        self._accept_task = asyncio.create_task(self._accept(), name="kv-tcp-accept")

    async def _accept(self) -> None:
        assert self._server is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._server)
            conn.setblocking(False)
            _no_delay(conn)
            task = asyncio.create_task(self._serve(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, sock: socket.socket) -> None:
        blocks = self._registered()
        conn: _Connection | None = None
        try:
            conn = await self._accepted(sock)
            reader = await self._authenticate(conn)  # None: unkeyed, the reader names itself
            while (request := await conn.read_frame()) is not None:
                ids, error = self._parse_read(request, blocks.shape[0])
                name = reader if reader is not None else request.get("reader")
                if not error and not self._allowed(request.get("lease"), ids, name):
                    error = "no live lease of this worker for this reader covers these blocks"
                    self.refusals += 1
                    log.warning("KV read by %r refused: %s (%d blocks)", name, error, len(ids))
                if error:
                    await conn.send_frame({"ok": False, "error": error})
                    continue
                await conn.send_frame({"ok": True, "nbytes": len(ids) * blocks.shape[1]})
                if self.staged:  # one gather and one copy out, then the bytes as one run
                    staged = await self._off_loop(_copy_out, blocks, ids)
                    await conn.send(memoryview(staged.numpy().reshape(-1)))
                    continue
                host = blocks.numpy()
                for block_id in ids:
                    await conn.send(memoryview(host[block_id]))
        except handoff.AuthError as exc:
            self.refusals += 1
            log.warning("KV connection refused: %s", exc)
        except ssl.SSLError as exc:
            self.refusals += 1
            log.warning("KV connection refused: its TLS handshake failed (%s)",
                        exc.reason or exc)
        except (OSError, FrameError, TimeoutError) as exc:
            log.debug("KV reader connection ended: %r", exc)
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()

    async def _accepted(self, sock: socket.socket) -> _Connection:
        if self._server_tls is None:
            return _Plain(sock)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, sock, ssl=self._server_tls,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)
        return _Tls(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def _authenticate(self, conn: _Connection) -> str | None:
        """The reader's proven name (None without a key)."""
        if self.key is None:
            return None
        return await handoff.accept(self.key, "kv", conn.send_frame, conn.read_frame)

    def _allowed(self, lease_id: object, ids: list[int], reader: object) -> bool:
        check = self.reads_allowed
        return (isinstance(lease_id, str) and isinstance(reader, str) and check is not None
                and check(lease_id, ids, reader))

    @staticmethod
    def _parse_read(request: dict[str, Any], num_blocks: int) -> tuple[list[int], str | None]:
        if request.get("op") != "read":
            return [], f"unknown op {request.get('op')!r}"
        ids = request.get("blocks")
        if not isinstance(ids, list) or len(ids) > MAX_BLOCKS_PER_READ or not all(
                type(b) is int for b in ids):
            return [], "blocks must be a list of block ids"
        bad = next((b for b in ids if not 0 <= b < num_blocks), None)
        if bad is not None:
            return [], f"block {bad} is outside the cache [0, {num_blocks})"
        return ids, None

    async def _close(self) -> None:
        tasks = [t for t in (self._accept_task, *self._handlers) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            self._server.close()
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._copier.shutdown(wait=True)

    async def _off_loop(self, copy: Callable[..., T], *args: Any) -> T:
        """``copy(*args)`` in a copy thread. Cancelled (a read's timeout), it still returns only
        once the copy ended: a copy into the cache must not outlive the read that made it."""
        done = asyncio.get_running_loop().run_in_executor(self._copier, copy, *args)
        cancelled = False
        while not done.done():
            try:
                await asyncio.wait([done])
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        return done.result()

    # -- reading --------------------------------------------------------------------------

    def _metadata(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "tls": self.tls is not None}

    def _add_peer(self, peer_id: str, metadata: Mapping[str, Any]) -> None:
        try:
            address = (str(metadata["host"]), int(metadata["port"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"peer {peer_id!r} sent unusable TCP metadata: {exc!r}") from None
        if bool(metadata.get("tls")) != (self.tls is not None):
            theirs, ours = ("TLS", "no") if metadata.get("tls") else ("plain TCP", "its own")
            raise KVTransferError(f"peer {peer_id!r} serves KV over {theirs} and this worker has "
                                  f"{ours} internal TLS: give every worker the same "
                                  f"{TLS_SETTINGS}")
        self._addresses[peer_id] = address

    def _remove_peer(self, peer_id: str) -> None:
        self._addresses.pop(peer_id, None)
        for conn in self._idle.pop(peer_id, []):
            conn.close()

    async def _read(self, peer_id: str, remote: list[int], local: list[int],
                    lease_id: str) -> None:
        blocks = self._registered()
        conn = await self._connection(peer_id)
        reusable = False
        try:
            await conn.send_frame({"op": "read", "lease": lease_id, "reader": self.name,
                                   "blocks": remote})
            reply = await conn.read_frame()
            if reply is None:
                raise KVTransferError(f"peer {peer_id!r} closed the connection")
            if "hello" in reply:
                raise KVTransferError(f"peer {peer_id!r} asks for the cluster handshake; this "
                                      f"worker has no cluster secret")
            if not reply.get("ok"):
                reusable = True
                raise KVTransferError(f"peer {peer_id!r} refused the read: {reply.get('error')}")
            if reply.get("nbytes") != len(remote) * blocks.shape[1]:
                raise KVTransferError(f"peer {peer_id!r} announced {reply.get('nbytes')} bytes")
            if self.staged:  # into a host buffer, then one copy in
                staging = torch.empty(len(local), blocks.shape[1], dtype=torch.uint8)
                await conn.recv_into(memoryview(staging.numpy().reshape(-1)))
                await self._off_loop(_copy_in, blocks, local, staging)
            else:
                host = blocks.numpy()
                for block_id in local:
                    await conn.recv_into(memoryview(host[block_id]))
            reusable = True
        except (OSError, FrameError) as exc:
            raise KVTransferError(f"TCP read from {peer_id!r} failed: {exc}") from None
        finally:
            # A connection left mid-message (error, timeout, cancellation) is not reused.
            if reusable and peer_id in self._addresses:
                self._idle.setdefault(peer_id, []).append(conn)
            else:
                conn.close()

    async def _connection(self, peer_id: str) -> _Connection:
        idle = self._idle.get(peer_id)
        if idle:
            return idle.pop()
        host, port = self._addresses[peer_id]
        try:
            conn = await self._connect(host, port)
        except ssl.SSLError as exc:
            raise KVTransferError(f"peer {peer_id!r} at {host}:{port}: the TLS handshake "
                                  f"failed ({exc.reason or exc})") from None
        except OSError as exc:
            raise KVTransferError(f"cannot connect to peer {peer_id!r} at {host}:{port}: "
                                  f"{exc}") from None
        if self.key is not None:
            try:
                await handoff.connect(self.key, "kv", self.name, conn.send_frame,
                                      conn.read_frame)
            except ssl.SSLError as exc:  # TLS 1.3: a refused certificate shows here
                conn.close()
                raise KVTransferError(f"peer {peer_id!r} at {host}:{port}: the TLS handshake "
                                      f"failed ({exc.reason or exc})") from None
            except (handoff.AuthError, OSError, FrameError) as exc:
                conn.close()
                hint = (" (over TLS, a peer that refuses this worker's certificate just closes "
                        "the connection: is internal_tls_cert_file signed by the CA in the "
                        "peer's internal_tls_ca_file?)" if self.tls is not None else "")
                raise KVTransferError(f"peer {peer_id!r} at {host}:{port}: {exc}{hint}") from None
            except BaseException:
                conn.close()
                raise
        return conn

    async def _connect(self, host: str, port: int) -> _Connection:
        if self._client_tls is not None:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._client_tls, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)
            _no_delay(writer.get_extra_info("socket"))
            return _Tls(reader, writer)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        _no_delay(sock)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return _Plain(sock)


def _no_delay(sock: Any) -> None:
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Connection(Protocol):
    """One KV connection: frames, and raw bytes after a frame that announces them."""

    async def send(self, data: bytes | memoryview) -> None: ...

    async def send_frame(self, frame: dict[str, Any]) -> None: ...

    async def read_frame(self) -> dict[str, Any] | None: ...

    async def recv_into(self, view: memoryview) -> None: ...

    def close(self) -> None: ...


class _Plain:
    """A non-blocking socket: bytes straight between it and the cache."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def send(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def send_frame(self, frame: dict[str, Any]) -> None:
        await self.send(encode_frame(frame))

    async def read_frame(self) -> dict[str, Any] | None:
        return await sock_read_frame(asyncio.get_running_loop(), self.sock)

    async def recv_into(self, view: memoryview) -> None:
        await sock_recv_into(asyncio.get_running_loop(), self.sock, view)

    def close(self) -> None:
        self.sock.close()


class _Tls:
    """A TLS stream (asyncio's): bytes through its buffers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes | memoryview) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_frame(self, frame: dict[str, Any]) -> None:
        await self.send(encode_frame(frame))

    async def read_frame(self) -> dict[str, Any] | None:
        return await read_frame(self.reader)

    async def recv_into(self, view: memoryview) -> None:
        while view:
            chunk = await self.reader.read(len(view))
            if not chunk:
                raise ConnectionError("peer closed the connection mid-message")
            view[:len(chunk)] = chunk
            view = view[len(chunk):]

    def close(self) -> None:
        self.writer.close()


def _copy_out(blocks: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Blocks ``ids`` of a device cache, gathered into one host tensor."""
    index = torch.tensor(ids, dtype=torch.long, device=blocks.device)
    return blocks.index_select(0, index).cpu()


def _copy_in(blocks: torch.Tensor, ids: list[int], staging: torch.Tensor) -> None:
    """Host rows ``staging`` into blocks ``ids`` of a device cache, landed when this returns
    (the read's promise: nothing writes into its blocks after it)."""
    index = torch.tensor(ids, dtype=torch.long, device=blocks.device)
    blocks.index_copy_(0, index, staging.to(blocks.device))
    if blocks.is_cuda:
        torch.cuda.current_stream(blocks.device).synchronize()
