"""Build a transport by name: "nixl", "tcp", or "auto" (NIXL when it loads, else TCP).

Imports the transports (and torch) only when one is built, so configuration code can read
``TRANSPORTS`` without them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.kv_transfer.transport import KVTransport, TransferFaults

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "tcp", "auto")


def nixl_available() -> bool:
    try:
        import services.kv_transfer.nixl_transport  # noqa: F401
    except ImportError:
        return False
    return True


def make_transport(kind: str, name: str, faults: TransferFaults | None = None,
                   host: str = "127.0.0.1") -> KVTransport:
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if kind == "auto":
        kind = "nixl" if nixl_available() else "tcp"
        log.info("KV transport: %s", kind)
    if kind == "nixl":
        try:
            from services.kv_transfer.nixl_transport import NixlTransport
        except ImportError as exc:
            from services.kv_transfer.transport import KVTransferError

            raise KVTransferError(
                f"the NIXL transport needs the nixl-cu12 package ({exc}); use transport 'tcp'"
            ) from None
        return NixlTransport(name, faults)
    from services.kv_transfer.tcp_transport import TcpTransport

    return TcpTransport(name, faults, host=host)
