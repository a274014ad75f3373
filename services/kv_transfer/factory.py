"""Build a transport by name: "nixl", "tcp", or "auto" (NIXL when it loads, else TCP).

Imports the transports (and torch) only when one is built, so configuration code can read
``TRANSPORTS`` without them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.control.auth import ClusterKey
    from services.kv_transfer.transport import KVTransport, TransferFaults

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "tcp", "auto")


def nixl_problem(device: str) -> str | None:
    """Why NIXL cannot move this worker's KV cache (None: it can): not installed, or it
    cannot register memory on ``device`` (a GPU whose memory its UCX cannot reach)."""
    try:
        from services.kv_transfer.nixl_transport import vram_problem
    except ImportError as exc:
        return f"NIXL is not installed ({exc})"
    return vram_problem(device)


def make_transport(kind: str, name: str, faults: TransferFaults | None = None,
                   host: str = "127.0.0.1", device: str = "cpu",
                   key: ClusterKey | None = None) -> KVTransport:
    """The transport for a worker whose KV cache lives on ``device``; ``key``: the cluster
    secret its connections prove (services/control/auth.py). ``auto`` takes NIXL
    when it can move that memory, else TCP (through host memory for a GPU cache): a fallback
    a GPU worker logs as a warning and reports (``fallback_reason``, a metric)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    fallback_reason = None
    if kind == "auto":
        fallback_reason = nixl_problem(device)
        kind = "tcp" if fallback_reason is not None else "nixl"
        if fallback_reason is not None and device != "cpu":
            log.warning("KV transport: TCP through host memory, because %s", fallback_reason)
        else:
            log.info("KV transport: %s", kind)
            fallback_reason = None  # on a CPU, TCP is a choice, not a fallback
    if kind == "nixl":
        try:
            from services.kv_transfer.nixl_transport import NixlTransport
        except ImportError as exc:
            from services.kv_transfer.transport import KVTransferError

            raise KVTransferError(
                f"the NIXL transport needs the nixl-cu12 package ({exc}); use transport 'tcp'"
            ) from None
        return NixlTransport(name, faults, key)
    from services.kv_transfer.tcp_transport import TcpTransport

    transport = TcpTransport(name, faults, host=host, key=key)
    transport.fallback_reason = fallback_reason
    return transport
