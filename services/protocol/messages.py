"""What travels between the gateway, the router and the worker replicas, one type per thing.

- ``WorkerInfo`` / ``WorkerLoad``: what a worker is (fixed) and how busy it is (each report),
  as the router's registry keeps them.
- ``GenerationRequest`` (services/protocol/request.py): the request, as the gateway built it; P's
  ``PrefillResult`` (services/protocol/handoff.py) rides in it to D.
- ``WorkerReport``: a worker's load and its queued KV events (in-process mode), sent with every
  response and status poll.
- ``RequestOutput`` (services/protocol/outputs.py) carries the tokens; on a decode channel (one
  stream per gateway and decode replica, services/serving/decode_channel.py) each names its
  request, and ``RequestDone`` ends one request's part of the channel.

Ray serializes these between our own processes; no client input reaches them unvalidated (the
gateway builds them from parsed, checked fields). No torch, no Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.services.protocol.block_hash import HASH_SCHEME, HashSettings
from tandem.services.protocol.outputs import UnavailableError


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker is; fixed for its lifetime."""

    worker_id: str
    role: str  # "prefill" or "decode"
    address: str
    block_size: int
    model_id: str
    capacity_blocks: int
    hash_scheme: str = HASH_SCHEME
    # Opaque strings for peers (e.g. base64 NIXL agent metadata), exchanged once per peer.
    metadata: Mapping[str, str] = field(default_factory=dict)

    def hash_settings(self) -> HashSettings:
        return HashSettings(self.block_size, self.model_id, self.hash_scheme)


@dataclass(frozen=True)
class WorkerLoad:
    """How busy a worker is, sampled when it heartbeats."""

    pending_prefill_blocks: int = 0  # prompt blocks queued or being computed, cache hits excluded
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    running_sequences: int = 0


# Upper bounds (s) of the KV transfer time histogram: shared memory on one host up to a slow
# network between nodes. A decode worker counts its pulls in these buckets; the gateway exports
# them as a histogram.
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                            5.0, 10.0)


class ReplicaGoneError(UnavailableError):
    """The replica the router named is not the one the call reached (it is gone or being
    replaced). The caller fails over explicitly; see services/serving/request_router.py.
    With nowhere left to fail over to, the client gets 503 + Retry-After."""


class ChannelClosedError(ReplicaGoneError):
    """A call named a decode channel the replica does not have (never opened, or closed): the
    gateway drops its side of the channel, reopens it and fails the request over."""


@dataclass(frozen=True)
class RequestDone:
    """The end of one request's outputs on a decode channel: its engine stream ended (after its
    finished output, or aborted), or failed with ``error`` (one of our own exceptions, e.g.
    ``EngineDeadError``, ``RequestError``)."""

    request_id: str
    error: BaseException | None = None


@dataclass(frozen=True)
class WorkerReport:
    worker_id: str
    seq: int  # per worker, increasing: the gateway keeps the newest load
    load: WorkerLoad
    events: list[str] = field(default_factory=list)  # wire-encoded, numbered KV events
