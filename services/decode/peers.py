"""What a decode worker needs from a prefill worker: a local object or a remote client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.services.kv_transfer.pairing import PairingInfo


class PrefillPeer(Protocol):
    async def pair(self, info: PairingInfo) -> PairingInfo: ...

    async def release(self, lease_id: str, reader: str) -> bool: ...

    async def reject(self, lease_id: str, reason: str) -> bool: ...


@dataclass(frozen=True)
class PeerLink:
    peer: PrefillPeer
    info: PairingInfo
