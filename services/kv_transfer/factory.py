"""Build a transport by name: "nixl", "tcp", or "auto" (NIXL when it loads, else TCP).

Imports the transports (and torch) only when one is built, so configuration code can read
``TRANSPORTS`` without them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.services.kv_transfer.transport import KVTransport, TransferFaults
    from tandem.services.protocol.handoff import ClusterKey
    from tandem.services.tls import InternalTLS

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "tcp", "auto")
NIXL_WITH_TLS = ("kv_transport nixl cannot take internal TLS (NIXL's UCX moves KV bytes "
                 "unencrypted): use kv_transport tcp or auto (TCP over mutual TLS)")


def make_transport(kind: str, name: str, faults: TransferFaults | None = None,
                   host: str = "127.0.0.1", device: str = "cpu",
                   key: ClusterKey | None = None,
                   kv_cache: torch.Tensor | None = None,
                   tls: InternalTLS | None = None) -> KVTransport:
    """The transport for a worker whose KV cache lives on ``device``; ``key``: the cluster
    secret its connections prove (services/protocol/handoff.py); ``tls``: the workers' mutual
    TLS, which only TCP speaks (NIXL's UCX moves bytes unencrypted): ``auto`` then takes TCP,
    and ``nixl`` is refused. Otherwise ``auto`` takes NIXL
    when it can move that memory, else TCP (through host memory for a GPU cache): a fallback
    the worker logs as a warning and reports (``fallback_reason``, a metric).

    ``kv_cache``: the tensor the worker will ``start`` the transport with. Given, NIXL
    registers it here: the real cache, tens of GB on a GPU, can fail where a small probe
    (``vram_problem``, all there is without it) passed. ``auto`` then falls back to TCP, and
    ``nixl`` raises ``KVTransferError`` naming the cache's size and NIXL's error."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    from tandem.services.kv_transfer.transport import KVTransferError

    if tls is not None:
        if kind == "nixl":
            raise KVTransferError(NIXL_WITH_TLS)
        log.info("KV transport: tcp over mutual TLS")
        return _tcp(name, faults, host, key, tls=tls)
    if kind == "tcp":
        return _tcp(name, faults, host, key)

    on_gpu = (str(kv_cache.device) if kv_cache is not None else device) != "cpu"
    try:
        from tandem.services.kv_transfer.nixl_transport import NixlTransport, vram_problem
    except ImportError as exc:
        if kind == "nixl":
            raise KVTransferError(
                f"the NIXL transport needs the nixl-cu12 package ({exc}); use transport 'tcp'"
            ) from None
        if not on_gpu:  # on a CPU, TCP for want of NIXL is a choice, not a fallback
            log.info("KV transport: tcp (NIXL is not installed)")
            return _tcp(name, faults, host, key)
        return _fallback(name, faults, host, key, f"NIXL is not installed ({exc})", on_gpu)
    transport = NixlTransport(name, faults, key)
    try:
        if kv_cache is not None:
            transport.register(kv_cache)
        elif kind == "auto" and (problem := vram_problem(device)) is not None:
            raise KVTransferError(problem)
    except KVTransferError as exc:
        if kind == "nixl":
            raise
        return _fallback(name, faults, host, key, str(exc), on_gpu)
    log.info("KV transport: nixl")
    return transport


def _fallback(name: str, faults: TransferFaults | None, host: str, key: ClusterKey | None,
              reason: str, on_gpu: bool) -> KVTransport:
    """TCP where ``auto`` wanted NIXL and NIXL cannot: one warning line says why."""
    log.warning("KV transport: TCP%s, because %s", " through host memory" if on_gpu else "",
                reason)
    return _tcp(name, faults, host, key, reason)


def _tcp(name: str, faults: TransferFaults | None, host: str, key: ClusterKey | None,
         fallback_reason: str | None = None, tls: InternalTLS | None = None) -> KVTransport:
    from tandem.services.kv_transfer.tcp_transport import TcpTransport

    transport = TcpTransport(name, faults, host=host, key=key, tls=tls)
    transport.fallback_reason = fallback_reason
    return transport
