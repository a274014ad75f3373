"""The KV transport interface: register the cache once, meet each peer once, read blocks.

Transfers are pulls: the decode worker reads the prefill worker's blocks into its own. Block
ids index both workers' block-major caches; a block is one contiguous byte range, so a
transfer is one descriptor per block. Leases, release and reject are not the transport's
business: they travel on the control channel, where they get answers. A read names the lease
it reads under and the reader; a transport that serves reads itself (TCP) serves only reads
its owner's ``reads_allowed`` approves (the prefill worker: a live lease, offered to that
reader, covering those blocks; lease ids are random 128-bit values the prefill worker gives
only to the gateway, which hands them to the decode worker it chose), and with a cluster key
only to readers that proved the cluster secret. A worker that grants no lease (decode) serves
no read. NIXL reads are one-sided: the serving side's code never sees them; who can read is
whoever holds its agent metadata, which only pairing hands out (signed with the cluster key).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tandem.services.engine.kv_cache import block_bytes
from tandem.services.protocol.handoff import ClusterKey


class KVTransferError(RuntimeError):
    """A block transfer failed: the destination blocks hold nothing usable."""


class KVTransferTimeout(KVTransferError):
    """A block transfer did not finish in time."""


class KVTransferStuckError(KVTransferError):
    """A failed transfer could not be stopped within its settle deadline: it may still write
    into the destination blocks, so this worker's KV cache can no longer be trusted (the
    worker stops its engine and is replaced)."""


class KVChecksumError(KVTransferError):
    """Pulled blocks do not match the checksums the prefill worker computed."""


@dataclass
class TransferFaults:
    """Debug fault injection on the reading side: each count spoils that many upcoming reads."""

    corrupt_reads: int = 0  # flip a byte of the first pulled block after the read
    bad_descriptor_reads: int = 0  # address blocks past the end of the peer's registered cache
    delay_reads_s: float = 0.0  # stall every read this long first (inside its timeout)
    # NIXL: the read cannot be cancelled and never ends (a stuck NIC or peer), as seen by the
    # settle step after the read's timeout
    unstoppable_reads: int = 0


@dataclass(frozen=True)
class PeerRegion:
    """A peer's registered cache, as its metadata describes it."""

    num_blocks: int
    bytes_per_block: int


class KVTransport(ABC):
    kind: ClassVar[str]

    def __init__(self, name: str, faults: TransferFaults | None = None,
                 key: ClusterKey | None = None) -> None:
        self.name = name  # the worker id: a reader's name to the peers it reads from
        self.faults = faults or TransferFaults()
        self.key = key  # the cluster secret: connections prove it (transports that connect)
        self.refusals = 0  # connections or reads refused (no handshake, no lease for them)
        self._blocks: torch.Tensor | None = None  # [num_blocks, bytes_per_block] uint8 view
        self._peers: dict[str, PeerRegion] = {}
        self._peer_metadata: dict[str, dict[str, Any]] = {}
        # Set by make_transport when "auto" fell back to this one: why NIXL could not serve.
        self.fallback_reason: str | None = None
        # Whether a read under (lease id, block ids) by (reader) may have this worker's
        # blocks; None: no read may.
        self.reads_allowed: Callable[[str, Sequence[int], str], bool] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self, kv_cache: torch.Tensor) -> None:
        """Register the worker's whole KV cache (once) and start serving peers' reads."""
        if self._blocks is not None:
            raise RuntimeError(f"transport {self.name} already has a registered KV cache")
        self._blocks = block_bytes(kv_cache)
        await self._start(kv_cache)

    async def close(self) -> None:
        for peer_id in list(self._peers):
            self.remove_peer(peer_id)
        await self._close()

    # -- peers ----------------------------------------------------------------------------

    def expect_reads(self, for_s: float) -> None:
        """Peers may read our blocks (or wire up to us) at any moment for the next ``for_s``:
        a transport that must progress for them does so briskly until then, and idles after.
        Nothing to do for one that serves reads as they come."""
        return None

    def describe(self) -> dict[str, Any]:
        """What a worker's status says of its transport."""
        return {"kv_transport": self.kind, "kv_transport_fallback": self.fallback_reason}

    def metadata(self) -> dict[str, Any]:
        """JSON-able description of this worker's cache for peers (exchanged once per peer)."""
        blocks = self._registered()
        return {"num_blocks": blocks.shape[0], "bytes_per_block": blocks.shape[1],
                **self._metadata()}

    def add_peer(self, peer_id: str, metadata: Mapping[str, Any]) -> None:
        """Remember a peer's cache; a no-op when it is already known with the same metadata."""
        if self._peer_metadata.get(peer_id) == metadata:
            return
        if peer_id in self._peers:
            self.remove_peer(peer_id)
        try:
            region = PeerRegion(int(metadata["num_blocks"]), int(metadata["bytes_per_block"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"peer {peer_id!r} sent unusable metadata: {exc!r}") from None
        if region.bytes_per_block != self._registered().shape[1]:
            raise KVTransferError(
                f"peer {peer_id!r} has {region.bytes_per_block}-byte blocks, this worker "
                f"{self._registered().shape[1]}-byte blocks"
            )
        self._add_peer(peer_id, metadata)
        self._peers[peer_id] = region
        self._peer_metadata[peer_id] = dict(metadata)

    def remove_peer(self, peer_id: str) -> None:
        if self._peers.pop(peer_id, None) is not None:
            self._peer_metadata.pop(peer_id, None)
            self._remove_peer(peer_id)

    def has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peers

    # -- transfers ------------------------------------------------------------------------

    async def read_blocks(self, peer_id: str, remote_block_ids: Sequence[int],
                          local_block_ids: Sequence[int], timeout_s: float,
                          lease_id: str = "") -> int:
        """Copy the peer's blocks into ours, pairwise, under the peer's lease ``lease_id``;
        returns the bytes moved.

        Raises ``KVTransferError`` (``KVTransferTimeout`` after ``timeout_s``). When this
        returns or raises, nothing is writing into the local blocks any more, except after
        ``KVTransferStuckError``: the cache is then unsafe to use at all.
        """
        blocks = self._registered()
        region = self._peers.get(peer_id)
        if region is None:
            raise KVTransferError(f"transport {self.name} has not met peer {peer_id!r}")
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        _check_ids(remote_block_ids, region.num_blocks, f"peer {peer_id!r}")
        _check_ids(local_block_ids, blocks.shape[0], "this worker")
        remote = list(remote_block_ids)
        if self.faults.bad_descriptor_reads > 0:
            self.faults.bad_descriptor_reads -= 1
            remote = [b + region.num_blocks for b in remote]
        try:
            async with asyncio.timeout(timeout_s):
                if self.faults.delay_reads_s:
                    await asyncio.sleep(self.faults.delay_reads_s)
                await self._read(peer_id, remote, list(local_block_ids), lease_id)
        except TimeoutError:
            raise KVTransferTimeout(
                f"reading {len(remote)} blocks from {peer_id!r} took over {timeout_s:g}s"
            ) from None
        if self.faults.corrupt_reads > 0 and local_block_ids:
            self.faults.corrupt_reads -= 1
            blocks[local_block_ids[0], 0] ^= 0xFF
        return len(remote) * blocks.shape[1]

    # -- implementations ------------------------------------------------------------------

    @abstractmethod
    async def _start(self, kv_cache: torch.Tensor) -> None: ...

    @abstractmethod
    async def _close(self) -> None: ...

    @abstractmethod
    def _metadata(self) -> dict[str, Any]: ...

    @abstractmethod
    def _add_peer(self, peer_id: str, metadata: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def _remove_peer(self, peer_id: str) -> None: ...

    @abstractmethod
    async def _read(self, peer_id: str, remote: list[int], local: list[int],
                    lease_id: str) -> None:
        """Raise ``KVTransferError`` on failure; on cancellation, return only once the
        transfer can no longer write into ``local``."""

    def _registered(self) -> torch.Tensor:
        if self._blocks is None:
            raise RuntimeError(f"transport {self.name} has no registered KV cache; call start()")
        return self._blocks


def _check_ids(block_ids: Sequence[int], num_blocks: int, owner: str) -> None:
    bad = next((b for b in block_ids if not 0 <= b < num_blocks), None)
    if bad is not None:
        raise KVTransferError(f"block {bad} is outside {owner}'s cache [0, {num_blocks})")
