"""KV events on the wire: a worker id, the worker's event sequence number and one engine event,
encoded as JSON with hex hashes. A stored/removed event of the host-memory tier carries
``"m": "host"``; the device tier's carry no ``m`` (as before the tier existed), so events of
either version decode alike.

A worker numbers its events 1, 2, 3, ... in emission order (``WorkerEventForwarder``); the
router applies them in that order and treats a gap as lost events (docs/router.md, Resync).

``InProcessEventBus``, the event bus for single-process runs: a bounded in-memory log with one
cursor per reader.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.services.protocol.kv_events import (
    DEVICE,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
)

WIRE_VERSION = 1


@dataclass(frozen=True)
class WorkerEvent:
    """One engine KV event, tagged with the worker that emitted it."""

    worker_id: str
    event: KVEvent
    seq: int | None = None  # the worker's event number; None: unnumbered (applied as it comes)


def encode_event(worker_id: str, event: KVEvent, seq: int | None = None) -> bytes:
    body: dict[str, object] = {"v": WIRE_VERSION, "w": worker_id}
    if seq is not None:
        body["s"] = seq
    if isinstance(event, BlockStored):
        body["k"] = "stored"
        body["h"] = [h.hex() for h in event.block_hashes]
        body["p"] = event.parent_hash.hex() if event.parent_hash is not None else None
        body["bs"] = event.block_size
        if event.medium != DEVICE:
            body["m"] = event.medium
    elif isinstance(event, BlockRemoved):
        body["k"] = "removed"
        body["h"] = [h.hex() for h in event.block_hashes]
        if event.medium != DEVICE:
            body["m"] = event.medium
    elif isinstance(event, AllBlocksCleared):
        body["k"] = "cleared"
    else:
        raise TypeError(f"not a KV event: {type(event).__name__}")
    return json.dumps(body, separators=(",", ":")).encode()


def decode_event(raw: bytes | str) -> WorkerEvent:
    """Inverse of ``encode_event``; raises ValueError on anything malformed."""
    try:
        body = json.loads(raw)
        if body.get("v") != WIRE_VERSION:
            raise ValueError(f"unsupported wire version {body.get('v')!r}")
        worker_id = body["w"]
        kind = body["k"]
        if not isinstance(worker_id, str):
            raise ValueError("worker id must be a string")
        seq = body.get("s")
        if seq is not None and (type(seq) is not int or seq < 1):
            raise ValueError(f"event sequence number must be a positive integer, not {seq!r}")
        event: KVEvent
        if kind == "stored":
            parent = body["p"]
            event = BlockStored(
                block_hashes=tuple(bytes.fromhex(h) for h in body["h"]),
                parent_hash=bytes.fromhex(parent) if parent is not None else None,
                block_size=int(body["bs"]),
                medium=_medium(body),
            )
        elif kind == "removed":
            event = BlockRemoved(block_hashes=tuple(bytes.fromhex(h) for h in body["h"]),
                                 medium=_medium(body))
        elif kind == "cleared":
            event = AllBlocksCleared()
        else:
            raise ValueError(f"unknown event kind {kind!r}")
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed KV event: {exc}") from exc
    return WorkerEvent(worker_id, event, seq)


def _medium(body: dict[str, object]) -> Medium:
    medium = body.get("m", DEVICE)
    if medium == HOST:
        return HOST
    if medium == DEVICE:
        return DEVICE
    raise ValueError(f"unknown KV medium {medium!r}")


class InProcessEventBus:
    """Thread-safe log of events; each subscription reads all of it at its own pace."""

    def __init__(self, max_events: int = 1_000_000) -> None:
        self._log: deque[WorkerEvent] = deque(maxlen=max_events)
        self._first_seq = 0  # sequence number of self._log[0]
        self._generation = 0
        self._cond = threading.Condition()

    def publish(self, events: Sequence[WorkerEvent]) -> None:
        with self._cond:
            for event in events:
                if len(self._log) == self._log.maxlen:
                    self._first_seq += 1
                self._log.append(event)
            self._cond.notify_all()

    def subscribe(self, replica_id: str) -> InProcessSubscription:
        return InProcessSubscription(self)

    def generation(self) -> str:
        with self._cond:
            return str(self._generation)

    def request_snapshots(self) -> None:
        with self._cond:
            self._generation += 1

    def _read(self, cursor: int, max_events: int, block_s: float) -> tuple[int, list[WorkerEvent]]:
        with self._cond:
            end = self._first_seq + len(self._log)
            if cursor >= end and block_s > 0:
                self._cond.wait_for(lambda: self._first_seq + len(self._log) > cursor, block_s)
                end = self._first_seq + len(self._log)
            cursor = max(cursor, self._first_seq)
            stop = min(end, cursor + max_events)
            base = self._first_seq
            events = [self._log[i - base] for i in range(cursor, stop)]
            return stop, events

    def _oldest(self) -> int:
        with self._cond:
            return self._first_seq


class InProcessSubscription:
    def __init__(self, bus: InProcessEventBus) -> None:
        self._bus = bus
        self._cursor = 0

    def open(self) -> None:
        self._cursor = self._bus._oldest()

    def read(self, max_events: int = 1000, block_s: float = 0.0) -> list[WorkerEvent]:
        self._cursor, events = self._bus._read(self._cursor, max_events, block_s)
        return events

    def close(self) -> None:
        pass
