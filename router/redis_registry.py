"""The worker registry in Redis: one hash per worker with a TTL, plus a set of ids."""

from __future__ import annotations

import json
import logging
import time

import redis

from tandem.router.errors import RegistryUnavailable, SettingsMismatch
from tandem.router.redis_conn import REDIS_ERRORS
from tandem.router.registry import IDLE, Clock, WorkerInfo, WorkerLoad, WorkerRecord, validate_info
from tandem.services.protocol.block_hash import HashSettings

log = logging.getLogger(__name__)


class RedisRegistry:
    """Keys: ``{prefix}:workers`` (set of ids), ``{prefix}:worker:{id}`` (hash, PEXPIRE ttl),
    ``{prefix}:hash-settings`` (JSON, written once by the first router).

    Every Redis failure (no connection, a timeout, an error reply such as READONLY or OOM)
    raises ``RegistryUnavailable``."""

    def __init__(
        self,
        client: redis.Redis,
        settings: HashSettings | None = None,
        ttl_s: float = 5.0,
        prefix: str = "tandem",
        clock: Clock = time.time,
    ) -> None:
        self.client = client
        self._settings = settings
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._clock = clock
        self._ids_key = f"{prefix}:workers"
        self._settings_key = f"{prefix}:hash-settings"

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def register(self, info: WorkerInfo, load: WorkerLoad = IDLE) -> None:
        validate_info(info, self.cluster_settings() or self._settings)
        key = self._worker_key(info.worker_id)
        fields = {
            "role": info.role,
            "address": info.address,
            "block_size": info.block_size,
            "model_id": info.model_id,
            "capacity_blocks": info.capacity_blocks,
            "hash_scheme": info.hash_scheme,
            "metadata": json.dumps(dict(info.metadata)),
            "pending_prefill_blocks": load.pending_prefill_blocks,
            "kv_usage": load.kv_usage,
            "running_sequences": load.running_sequences,
            "updated_at": repr(self._clock()),
        }
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=fields)
                pipe.hincrby(key, "heartbeat_seq", 1)
                pipe.pexpire(key, max(int(self.ttl_s * 1000), 1))
                pipe.sadd(self._ids_key, info.worker_id)
                pipe.execute()
        except REDIS_ERRORS as exc:
            raise RegistryUnavailable(f"cannot register {info.worker_id}: {exc}") from exc

    def deregister(self, worker_id: str) -> None:
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(self._worker_key(worker_id))
                pipe.srem(self._ids_key, worker_id)
                pipe.execute()
        except REDIS_ERRORS as exc:
            raise RegistryUnavailable(f"cannot deregister {worker_id}: {exc}") from exc

    def workers(self) -> list[WorkerRecord]:
        try:
            ids = sorted(m.decode() for m in self.client.smembers(self._ids_key))
            with self.client.pipeline(transaction=False) as pipe:
                for worker_id in ids:
                    pipe.hgetall(self._worker_key(worker_id))
                rows = pipe.execute()
        except REDIS_ERRORS as exc:
            raise RegistryUnavailable(f"cannot list workers: {exc}") from exc
        self._forget_lapsed([w for w, row in zip(ids, rows, strict=True) if not row])
        records = []
        for worker_id, row in zip(ids, rows, strict=True):
            if not row:
                continue
            try:
                records.append(_parse(worker_id, row))
            except (KeyError, ValueError) as exc:
                log.warning("skipping malformed registry record for %s: %s", worker_id, exc)
        return records

    def cluster_settings(self) -> HashSettings | None:
        try:
            raw = self.client.get(self._settings_key)
        except REDIS_ERRORS as exc:
            raise RegistryUnavailable(f"cannot read cluster settings: {exc}") from exc
        if raw is None:
            return None
        body = json.loads(raw)
        return HashSettings(int(body["block_size"]), str(body["model_id"]), str(body["scheme"]),
                            str(body.get("kv_cache_dtype", "auto")))

    def publish_settings(self, settings: HashSettings) -> None:
        raw = json.dumps(
            {"block_size": settings.block_size, "model_id": settings.model_id,
             "scheme": settings.scheme, "kv_cache_dtype": settings.kv_cache_dtype},
            sort_keys=True,
        )
        try:
            self.client.set(self._settings_key, raw, nx=True)
        except REDIS_ERRORS as exc:
            raise RegistryUnavailable(f"cannot publish cluster settings: {exc}") from exc
        current = self.cluster_settings()
        if current is not None and current != settings:
            raise SettingsMismatch(f"cluster uses {current}, this router {settings}")

    def _forget_lapsed(self, worker_ids: list[str]) -> None:
        """Drop lapsed ids from the set, unless they re-registered meanwhile. Best effort: a
        read-only or full Redis still lists workers (lapsed ids are skipped either way)."""
        for worker_id in worker_ids:
            try:
                # EXISTS and SREM in one MULTI would still race; a Lua script makes it atomic.
                self.client.eval(
                    "if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('SREM',"
                    " KEYS[1], ARGV[1]) end return 0",
                    2,
                    self._ids_key,
                    self._worker_key(worker_id),
                    worker_id,
                )
            except REDIS_ERRORS:
                return


def _parse(worker_id: str, row: dict[bytes, bytes]) -> WorkerRecord:
    f = {k.decode(): v.decode() for k, v in row.items()}
    info = WorkerInfo(
        worker_id=worker_id,
        role=f["role"],
        address=f["address"],
        block_size=int(f["block_size"]),
        model_id=f["model_id"],
        capacity_blocks=int(f["capacity_blocks"]),
        hash_scheme=f["hash_scheme"],
        metadata=json.loads(f.get("metadata", "{}")),
    )
    load = WorkerLoad(
        pending_prefill_blocks=int(f.get("pending_prefill_blocks", 0)),
        kv_usage=float(f.get("kv_usage", 0.0)),
        running_sequences=int(f.get("running_sequences", 0)),
    )
    return WorkerRecord(info, load, int(f.get("heartbeat_seq", 0)), float(f["updated_at"]))
