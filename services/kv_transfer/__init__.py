"""KV block transfer between workers: one interface, a NIXL and a plain TCP implementation."""

from services.kv_transfer.handle import KVHandle
from services.kv_transfer.pairing import PairingError, PairingInfo, check_pairing
from services.kv_transfer.transport import (
    KVChecksumError,
    KVTransferError,
    KVTransferTimeout,
    KVTransport,
    TransferFaults,
)

__all__ = [
    "KVChecksumError",
    "KVHandle",
    "KVTransferError",
    "KVTransferTimeout",
    "KVTransport",
    "PairingError",
    "PairingInfo",
    "TransferFaults",
    "check_pairing",
]
