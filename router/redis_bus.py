"""KV events through one Redis Stream; each router replica reads it with its own consumer group."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import redis

from tandem.router.errors import BusReset, BusUnavailable
from tandem.router.redis_conn import REDIS_ERRORS, server_run_id
from tandem.router.wire import WorkerEvent, decode_event, encode_event

log = logging.getLogger(__name__)

DEFAULT_STREAM = "tandem:kv-events"
_FIELD = b"e"


class RedisStreamEventBus:
    """Publishes with XADD (approximately trimmed to ``max_len`` entries); reads with XREADGROUP.

    Every replica has its own group, so every replica sees every event. Groups are read with
    NOACK: a replica that restarts re-reads the stream from its start anyway, so a pending-entries
    list would only grow. Every Redis failure (no connection, a timeout, an error reply such as
    READONLY or OOM) raises ``BusUnavailable``; only a vanished group raises ``BusReset``.
    """

    def __init__(
        self, client: redis.Redis, stream: str = DEFAULT_STREAM, max_len: int | None = 1_000_000
    ) -> None:
        self.client = client
        self.stream = stream
        self.max_len = max_len
        self._snapshot_key = f"{stream}:snapshot-requests"

    def publish(self, events: Sequence[WorkerEvent]) -> None:
        if not events:
            return
        try:
            with self.client.pipeline(transaction=True) as pipe:
                for event in events:
                    pipe.xadd(
                        self.stream,
                        {_FIELD: encode_event(event.worker_id, event.event, event.seq)},
                        maxlen=self.max_len,
                        approximate=True,
                    )
                pipe.execute()
        except REDIS_ERRORS as exc:
            # An error reply (READONLY replica, OOM under noeviction) loses the batch just like a
            # dropped connection: the forwarder marks itself for a resync.
            raise BusUnavailable(f"cannot publish KV events: {exc}") from exc

    def subscribe(self, replica_id: str) -> RedisStreamSubscription:
        return RedisStreamSubscription(self, group=f"router:{replica_id}", consumer=replica_id)

    def generation(self) -> str:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.info("server")
                pipe.get(self._snapshot_key)
                info, requests = pipe.execute()
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"cannot read bus generation: {exc}") from exc
        return f"{info['run_id']}:{int(requests or 0)}"

    def request_snapshots(self) -> None:
        try:
            self.client.incr(self._snapshot_key)
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"cannot request snapshots: {exc}") from exc

    def run_id(self) -> str:
        try:
            return server_run_id(self.client)
        except REDIS_ERRORS as exc:
            raise BusUnavailable(str(exc)) from exc


class RedisStreamSubscription:
    def __init__(self, bus: RedisStreamEventBus, group: str, consumer: str) -> None:
        self._bus = bus
        self.group = group
        self.consumer = consumer

    def open(self) -> None:
        client, stream = self._bus.client, self._bus.stream
        try:
            try:
                client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise  # READONLY, OOM, ...: unavailable, below
                # A replica restarting under the same id starts with an empty index: re-read.
                client.xgroup_setid(stream, self.group, id="0")
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"cannot open consumer group {self.group}: {exc}") from exc

    def read(self, max_events: int = 1000, block_s: float = 0.0) -> list[WorkerEvent]:
        block_ms = int(block_s * 1000) if block_s > 0 else None
        try:
            reply = self._bus.client.xreadgroup(
                self.group,
                self.consumer,
                {self._bus.stream: ">"},
                count=max_events,
                block=block_ms,
                noack=True,
            )
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                raise BusReset(f"stream or group {self.group} vanished") from exc
            raise BusUnavailable(f"cannot read KV events: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"cannot read KV events: {exc}") from exc
        events: list[WorkerEvent] = []
        for _stream, entries in _entries_of(reply):
            for _entry_id, fields in entries:
                raw = fields.get(_FIELD)
                if raw is None:
                    continue
                try:
                    events.append(decode_event(raw))
                except ValueError as exc:
                    log.warning("skipping malformed KV event %s: %s", _entry_id, exc)
        return events

    def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            self._bus.client.xgroup_destroy(self._bus.stream, self.group)


def _entries_of(reply: object) -> list[tuple[object, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP's reply as (stream, entries) pairs, for RESP2 (list) and RESP3 (dict) clients."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(stream, entries) for stream, entries in reply.items()]
    return [(stream, entries) for stream, entries in reply]  # type: ignore[attr-defined]
