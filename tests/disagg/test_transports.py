"""The transports alone: TCP staged through host buffers (how a GPU cache moves where NIXL
cannot; the copies off the event loop), and ``auto``'s choice, made by registering the real
cache, with its fallback said in the log, the status and a metric."""

from __future__ import annotations

import asyncio
import importlib
import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.services.cli import main as tandem
from tandem.services.handoff.prefill import LeaseTable
from tandem.services.kv_transfer import nixl_transport
from tandem.services.kv_transfer.factory import make_transport
from tandem.services.kv_transfer.framing import encode_frame, read_frame
from tandem.services.kv_transfer.tcp_transport import TcpTransport
from tandem.services.kv_transfer.transport import KVTransferError, KVTransport
from tandem.services.protocol.handoff import ClusterKey
from tandem.services.protocol.outputs import EngineStats
from tandem.services.serving.cluster_view import WorkerSnapshot
from tandem.services.serving.config import AppConfig, ConfigError
from tandem.services.serving.metrics import WorkerCollector
from tandem.services.tls import InternalTLS, TLSConfigError
from tests.certs import issue

NUM_BLOCKS, BLOCK_SHAPE = 12, (2, 2, 4, 3, 8)  # block-major: [blocks, layers, k/v, ...]


def _cache(seed: int) -> torch.Tensor:
    return torch.randn(NUM_BLOCKS, *BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("server_staged", "reader_staged"),
                         [(True, True), (True, False), (False, True)])
def test_staged_tcp_moves_exactly_the_named_blocks(server_staged: bool,
                                                   reader_staged: bool) -> None:
    # Staging is what a GPU cache gets (gather, one copy out / one copy in); it speaks the
    # same wire format as the direct path, so either side may stage.
    async def scenario() -> None:
        source, dest = _cache(1), _cache(2)
        expected = dest.clone()
        server = TcpTransport("p0", staged=server_staged)
        reader = TcpTransport("d0", staged=reader_staged)
        leases = LeaseTable(30)
        server.reads_allowed = leases.covers
        await server.start(source)
        await reader.start(dest)
        try:
            reader.add_peer("p0", server.metadata())
            remote, local = [7, 0, 11, 3], [2, 9, 0, 5]
            lease = leases.grant("r", remote, reader="d0")
            moved = await reader.read_blocks("p0", remote, local, timeout_s=10,
                                             lease_id=lease.lease_id)
            assert moved == len(remote) * source[0].numel() * source.element_size()
            expected[local] = source[remote]
            assert torch.equal(dest, expected)  # the named blocks, and nothing else
            assert await reader.read_blocks("p0", [], [], timeout_s=10,
                                            lease_id=lease.lease_id) == 0
        finally:
            await reader.close()
            await server.close()

    asyncio.run(scenario())


def _watched(cache: torch.Tensor, calls: list[tuple[str, int]]) -> torch.Tensor:
    """``cache`` (no copy), noting in ``calls`` each torch call on it or its views, and the
    thread that made it."""
    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            calls.append((getattr(func, "__name__", repr(func)), threading.get_ident()))
            return super().__torch_function__(func, types, args, kwargs or {})

    return cache.as_subclass(Watched)


COPIES = {"index_select", "index_copy_", "cpu", "to", "copy_", "clone", "contiguous",
          "__getitem__", "__setitem__"}  # what copies blocks of a cache (or writes them)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "host cache"])
def test_staging_copies_run_off_the_event_loop_and_a_host_cache_has_none(staged: bool) -> None:
    """A GPU cache's gather and copy out (serving) and copy in (reading) block for as long as
    the device takes: they run in the transport's threads, never on the event loop, which
    serves every other connection meanwhile. A host cache is not copied at all: the socket
    reads and writes its blocks in place."""
    calls: list[tuple[str, int]] = []

    async def scenario() -> int:
        source, dest = _cache(1), _cache(2)
        expected = dest.clone()
        server = TcpTransport("p0", staged=staged)
        reader = TcpTransport("d0", staged=staged)
        leases = LeaseTable(30)
        server.reads_allowed = leases.covers
        await server.start(_watched(source, calls))
        await reader.start(_watched(dest, calls))
        try:
            reader.add_peer("p0", server.metadata())
            remote, local = [7, 0, 11, 3], [2, 9, 0, 5]
            lease = leases.grant("r", remote, reader="d0")
            calls.clear()
            await reader.read_blocks("p0", remote, local, timeout_s=10, lease_id=lease.lease_id)
            moved = list(calls)
            calls.clear()
            expected[local] = source[remote]
            assert torch.equal(dest, expected)
        finally:
            await reader.close()
            await server.close()
        calls[:] = moved
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    copies = [(name, thread) for name, thread in calls if name in COPIES]
    if staged:
        assert {"index_select", "index_copy_"} <= {name for name, _ in copies}
        assert [name for name, thread in copies if thread == loop_thread] == []
    else:
        assert copies == []


def test_a_cancelled_read_returns_only_once_its_copy_in_ended() -> None:
    """A read cancelled (its timeout) while its copy into the cache runs in a copy thread
    returns only after that copy: the caller may reuse the blocks at once."""
    entered, gate, ended = threading.Event(), threading.Event(), threading.Event()

    class Gated(torch.Tensor):  # its copy in waits for the gate
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if getattr(func, "__name__", "") != "index_copy_":
                return super().__torch_function__(func, types, args, kwargs or {})
            entered.set()
            gate.wait(30)
            try:
                return super().__torch_function__(func, types, args, kwargs or {})
            finally:
                ended.set()

    async def scenario() -> None:
        source, dest = _cache(1), _cache(2)
        server, reader = TcpTransport("p0"), TcpTransport("d0", staged=True)
        leases = LeaseTable(30)
        server.reads_allowed = leases.covers
        await server.start(source)
        await reader.start(dest.as_subclass(Gated))
        try:
            reader.add_peer("p0", server.metadata())
            lease = leases.grant("r", [1, 2], reader="d0")
            read = asyncio.create_task(reader.read_blocks("p0", [1, 2], [3, 4], timeout_s=30,
                                                          lease_id=lease.lease_id))
            await asyncio.to_thread(entered.wait, 30)
            read.cancel()
            done, _ = await asyncio.wait([read], timeout=0.2)
            assert not done  # the loop runs on, the read waits for its copy
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await read
            assert ended.is_set()
            assert torch.equal(dest[3:5], source[1:3])  # the copy it waited for
        finally:
            gate.set()
            await reader.close()
            await server.close()

    asyncio.run(scenario())


def test_a_read_needs_a_live_lease_covering_its_blocks() -> None:
    """Over TCP a read names its lease: no lease, an unknown or expired one, blocks beyond
    it, or a worker that grants none (a decode worker) and nothing is read."""
    async def scenario() -> None:
        now = [0.0]
        leases = LeaseTable(30, clock=lambda: now[0])
        source, dest = _cache(1), _cache(2)
        untouched = dest.clone()
        server, reader = TcpTransport("p0"), TcpTransport("d0")
        server.reads_allowed = leases.covers
        await server.start(source)
        await reader.start(dest)
        try:
            reader.add_peer("p0", server.metadata())
            lease = leases.grant("r", [1, 2])
            for lease_id, blocks in (("", [1]), ("f" * 32, [1]), (lease.lease_id, [1, 3])):
                with pytest.raises(KVTransferError, match="no live lease"):
                    await reader.read_blocks("p0", blocks, [0] * len(blocks), timeout_s=10,
                                             lease_id=lease_id)
            assert torch.equal(dest, untouched)
            await reader.read_blocks("p0", [2], [0], timeout_s=10, lease_id=lease.lease_id)
            assert torch.equal(dest[0], source[2])
            now[0] = 31.0  # expired
            with pytest.raises(KVTransferError, match="no live lease"):
                await reader.read_blocks("p0", [1], [4], timeout_s=10, lease_id=lease.lease_id)
            # The reader's own cache (no lease table) serves nobody.
            server.add_peer("d0", reader.metadata())
            with pytest.raises(KVTransferError, match="no live lease"):
                await server.read_blocks("d0", [0], [5], timeout_s=10, lease_id="any")
            assert torch.equal(source, _cache(1))
        finally:
            await reader.close()
            await server.close()

    asyncio.run(scenario())


SECRET = b"s" * 40


def test_keyed_reads_need_the_cluster_secret_and_a_lease_for_this_reader() -> None:
    """With the cluster key, a reader without it (or with another secret) is refused at the
    handshake; one with it reads only under a lease offered to its own name."""
    async def scenario() -> None:
        leases = LeaseTable(30)
        source, dest = _cache(1), _cache(2)
        untouched = dest.clone()
        server = TcpTransport("p0", key=ClusterKey(SECRET))
        server.reads_allowed = leases.covers
        readers = {"none": TcpTransport("d0"),
                   "other secret": TcpTransport("d0", key=ClusterKey(b"t" * 40)),
                   "d0": TcpTransport("d0", key=ClusterKey(SECRET)),
                   "d1": TcpTransport("d1", key=ClusterKey(SECRET))}
        await server.start(source)
        for reader in readers.values():
            await reader.start(dest)
            reader.add_peer("p0", server.metadata())
        try:
            lease = leases.grant("r", [1, 2], reader="d0")
            for name, match in (("none", "handshake"), ("other secret", "handshake"),
                                ("d1", "no live lease")):
                with pytest.raises(KVTransferError, match=match):
                    await readers[name].read_blocks("p0", [1], [0], timeout_s=10,
                                                    lease_id=lease.lease_id)
            assert torch.equal(dest, untouched)
            assert server.refusals == 3
            await readers["d0"].read_blocks("p0", [2], [0], timeout_s=10,
                                            lease_id=lease.lease_id)
            assert torch.equal(dest[0], source[2])
            # A client that skips the handshake and sends a read gets an error, no bytes.
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            assert (await read_frame(reader) or {}).get("hello")
            writer.write(encode_frame({"op": "read", "lease": lease.lease_id, "reader": "d0",
                                       "blocks": [1]}))
            refusal = await read_frame(reader)
            assert refusal is not None and "unauthenticated" in refusal["error"]
            assert await reader.read() == b""  # closed: not one byte of KV
            writer.close()
        finally:
            for reader in readers.values():
                await reader.close()
            await server.close()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def cluster_ca(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], InternalTLS]:
    """Workers' internal TLS files: ``worker(name)``, a certificate this module's CA signed
    (no names in it: workers are reached by IP), with the CA; ``"stranger"`` one that another
    CA signed."""
    directory = tmp_path_factory.mktemp("internal-tls")
    ca, ca_cert, ca_key = issue(directory, "ca", "Tandem test cluster CA", [], ca=True)
    other_ca = issue(directory, "other-ca", "Another CA", [], ca=True)

    def worker(name: str) -> InternalTLS:
        signer = other_ca[1:] if name == "stranger" else (ca_cert, ca_key)
        credentials = issue(directory, name, name, [], issuer=signer)[0]
        return InternalTLS.read(credentials.cert_file, credentials.key_file, ca.cert_file)

    return worker


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "host cache"])
def test_tls_reads_move_the_named_blocks_and_refuse_other_cas(
        cluster_ca: Callable[[str], InternalTLS], staged: bool) -> None:
    """With internal TLS (and the cluster key) a reader whose certificate the CA signed reads
    exactly the named blocks; one without a certificate, or with another CA's, is refused at
    the TLS handshake (counted), and a plain client gets no frame back."""
    async def scenario() -> None:
        leases = LeaseTable(30)
        source, dest = _cache(1), _cache(2)
        expected = dest.clone()
        key = ClusterKey(SECRET)
        server = TcpTransport("p0", key=key, tls=cluster_ca("p0"), staged=staged)
        server.reads_allowed = leases.covers
        reader = TcpTransport("d0", key=key, tls=cluster_ca("d0"), staged=staged)
        stranger = TcpTransport("d0", key=key, tls=cluster_ca("stranger"))
        await server.start(source)
        for transport in (reader, stranger):
            await transport.start(dest)
            transport.add_peer("p0", server.metadata())
        try:
            remote, local = [7, 0, 11], [2, 9, 0]
            lease = leases.grant("r", remote, reader="d0")
            with pytest.raises(KVTransferError, match="refuses this worker's certificate"):
                await stranger.read_blocks("p0", remote, local, timeout_s=10,
                                           lease_id=lease.lease_id)
            assert torch.equal(dest, expected)
            # A client with no certificate (it trusts the CA): the server sends no frame (an
            # accepted connection would get the cluster handshake's hello first).
            context = ssl.create_default_context(cafile=cluster_ca("d1").ca_file)
            context.check_hostname = False
            raw, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
            try:
                frame = await read_frame(raw)
            except (ssl.SSLError, ConnectionError):
                frame = None
            assert frame is None
            writer.close()
            # A plain client (a worker without TLS, or anyone) gets no frame in the clear.
            raw, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(encode_frame({"op": "read", "lease": lease.lease_id, "reader": "d0",
                                       "blocks": remote}))
            assert b"hello" not in await raw.read()
            writer.close()
            moved = await reader.read_blocks("p0", remote, local, timeout_s=10,
                                             lease_id=lease.lease_id)
            assert moved == len(remote) * source[0].numel() * source.element_size()
            expected[local] = source[remote]
            assert torch.equal(dest, expected)
            assert server.refusals == 3  # the stranger, no certificate, plain TCP
        finally:
            for transport in (reader, stranger, server):
                await transport.close()

    asyncio.run(scenario())


def test_tls_and_plain_workers_do_not_pair(cluster_ca: Callable[[str], InternalTLS]) -> None:
    async def scenario() -> None:
        tls, plain = TcpTransport("p0", tls=cluster_ca("p0")), TcpTransport("d0")
        await tls.start(_cache(1))
        await plain.start(_cache(2))
        try:
            for reader, server, says in (
                    (plain, tls, "serves KV over TLS and this worker has no"),
                    (tls, plain, "plain TCP and this worker has its own")):
                with pytest.raises(KVTransferError, match=says + ".*internal_tls_cert_file"):
                    reader.add_peer(server.name, server.metadata())
        finally:
            await tls.close()
            await plain.close()

    asyncio.run(scenario())


def test_internal_tls_takes_tcp_and_refuses_nixl(cluster_ca: Callable[[str], InternalTLS],
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    tls = cluster_ca("p0")
    for kind in ("auto", "tcp"):
        transport = make_transport(kind, "p0", tls=tls)
        assert isinstance(transport, TcpTransport) and transport.tls is tls
    with pytest.raises(KVTransferError, match="nixl cannot take internal TLS"):
        make_transport("nixl", "p0", tls=tls)
    files = {"internal_tls_cert_file": tls.cert_file, "internal_tls_key_file": tls.key_file,
             "internal_tls_ca_file": tls.ca_file}
    assert AppConfig(**files).internal_tls() == tls  # type: ignore[arg-type]
    assert AppConfig().internal_tls() is None
    with pytest.raises(ConfigError, match="nixl cannot take internal TLS"):
        AppConfig(kv_transport="nixl", **files)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="all three files or none: internal_tls_ca_file"):
        AppConfig(internal_tls_cert_file=tls.cert_file, internal_tls_key_file=tls.key_file)
    missing = str(tmp_path / "missing.crt")
    with pytest.raises(TLSConfigError, match=f"cannot read internal_tls_ca_file {missing}"):
        AppConfig(**{**files, "internal_tls_ca_file": missing}).internal_tls()  # type: ignore[arg-type]
    with pytest.raises(TLSConfigError, match="internal_tls_cert_file .* and internal_tls_key_"):
        AppConfig(**{**files, "internal_tls_key_file": tls.ca_file}).internal_tls()  # type: ignore[arg-type]
    # `tandem up` refuses them before it starts anything (exit 2, the setting named).
    assert tandem(["up", "--internal-tls-cert-file", tls.cert_file, "--internal-tls-key-file",
                   tls.key_file, "--internal-tls-ca-file", missing]) == 2
    assert f"cannot read internal_tls_ca_file {missing}" in capsys.readouterr().err
    assert tandem(["up", "--kv-transport", "nixl", "--internal-tls-cert-file", tls.cert_file,
                   "--internal-tls-key-file", tls.key_file, "--internal-tls-ca-file",
                   tls.ca_file]) == 2
    assert "nixl cannot take internal TLS" in capsys.readouterr().err


def test_a_cpu_cache_is_not_staged_unless_asked() -> None:
    async def scenario() -> None:
        transport = TcpTransport("p0")
        await transport.start(_cache(0))
        try:
            assert transport.staged is False
        finally:
            await transport.close()

    asyncio.run(scenario())


def test_auto_takes_nixl_for_host_memory() -> None:
    transport = make_transport("auto", "w0", device="cpu")
    assert transport.describe() == {"kv_transport": "nixl", "kv_transport_fallback": None}


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU NIXL may well move its memory (no fallback to see)")
def test_auto_falls_back_to_tcp_when_nixl_cannot_move_gpu_memory(
        caplog: pytest.LogCaptureFixture) -> None:
    # Here no GPU exists, so NIXL truly cannot register CUDA memory: the probe says why.
    with caplog.at_level(logging.WARNING, logger="tandem.services.kv_transfer.factory"):
        transport = make_transport("auto", "w0", device="cuda")
    assert isinstance(transport, TcpTransport)
    assert transport.describe() == {"kv_transport": "tcp",
                                    "kv_transport_fallback": "torch sees no CUDA device"}
    [record] = caplog.records
    assert "TCP through host memory, because torch sees no CUDA device" in record.getMessage()
    # An explicit choice is not a fallback.
    assert make_transport("tcp", "w1", device="cuda").fallback_reason is None


class _LimitedAgent(nixl_transport.nixl_agent):  # type: ignore[misc]
    """NIXL's own agent, but refusing, with NIXL's error, to register more than 4 KB at once:
    as a GPU's registration or BAR limits refuse a cache of tens of GB that a 4 KB probe
    passed."""

    def register_memory(self, reg_list: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(reg_list, torch.Tensor) and reg_list.nbytes > 4096:
            errors = importlib.import_module(f"{nixl_transport._nixl.__name__}._bindings")
            raise errors.nixlBackendError("NIXL_ERR_BACKEND")
        return super().register_memory(reg_list, *args, **kwargs)


async def _read_all(server: KVTransport, reader: KVTransport, source: torch.Tensor,
                    dest: torch.Tensor) -> None:
    """Start both, read every block of ``source`` into ``dest`` (reversed), check, close."""
    leases = LeaseTable(30)
    server.reads_allowed = leases.covers
    await server.start(source)
    await reader.start(dest)
    try:
        reader.add_peer("p0", server.metadata())
        server.expect_reads(30)
        remote = list(range(NUM_BLOCKS))
        lease = leases.grant("r", remote, reader="d0")
        await reader.read_blocks("p0", remote, remote[::-1], timeout_s=30,
                                 lease_id=lease.lease_id)
        assert torch.equal(dest, source.flip(0))
    finally:
        await reader.close()
        await server.close()


def test_auto_registers_the_real_cache_and_reads_over_nixl() -> None:
    source, dest = _cache(1), _cache(2)
    server = make_transport("auto", "p0", kv_cache=source)
    reader = make_transport("auto", "d0", kv_cache=dest)
    assert reader.describe() == {"kv_transport": "nixl", "kv_transport_fallback": None}
    asyncio.run(_read_all(server, reader, source, dest))  # start() kept the registration


def test_auto_falls_back_to_tcp_when_nixl_cannot_register_the_real_cache(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(nixl_transport, "nixl_agent", _LimitedAgent)
    source, dest = _cache(1), _cache(2)  # 18432 bytes each
    with caplog.at_level(logging.INFO, logger="tandem.services.kv_transfer.factory"):
        reader = make_transport("auto", "d0", kv_cache=dest)
    reason = ("NIXL cannot register the KV cache of 18.0 KiB (18432 bytes) on cpu: "
              "NIXL_ERR_BACKEND")
    assert isinstance(reader, TcpTransport)
    assert reader.describe() == {"kv_transport": "tcp", "kv_transport_fallback": reason}
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (
        logging.WARNING, f"KV transport: TCP, because {reason}")
    asyncio.run(_read_all(TcpTransport("p0"), reader, source, dest))  # and KV moves
    # Asked for by name, NIXL fails the worker's start instead, saying why.
    with pytest.raises(KVTransferError, match=r"^NIXL cannot register the KV cache of 18\.0 "
                                              r"KiB \(18432 bytes\) on cpu: NIXL_ERR_BACKEND$"):
        make_transport("nixl", "d1", kv_cache=dest)


def test_the_fallback_is_a_metric() -> None:
    def snapshot(worker_id: str, fallback: str | None) -> WorkerSnapshot:
        stats = EngineStats(num_running=0, num_waiting=0, num_free_blocks=8, num_blocks=8,
                            kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                            num_preemptions=0)
        return WorkerSnapshot(worker_id, "decode", stats, kv_transport_fallback=fallback)

    collector = WorkerCollector("m", lambda: [snapshot("d0", "no VRAM"), snapshot("d1", None)])
    [family] = [f for f in collector.collect() if f.name == "tandem_kv_transport_fallback"]
    values = {s.labels["worker"]: s.value for s in family.samples}
    assert values == {"d0": 1.0, "d1": 0.0}
