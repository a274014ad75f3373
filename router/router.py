"""The router: picks a prefill and a decode worker for each prompt.

``route`` only reads in-memory state, so it never waits on Redis and never fails because Redis
is down. ``sync`` (called by a background thread, or explicitly) pulls KV events into the index
and refreshes the worker snapshot; when Redis is unreachable it keeps the last snapshot, routes
by rendezvous hashing, and on reconnect rebuilds the index from the stream plus fresh worker
snapshots.

Scoring: prefill by cache affinity against load, decode by power of two choices.

In flight (``InFlight``): the router's own assignments that workers have not reported yet. A
heartbeat's load is already stale when it arrives; without counting what it has just sent, a
router would send a whole burst to the worker that looked idle at the last heartbeat. An entry
counts until the worker reports a heartbeat taken after it, the caller releases the request, or
``max_age_s`` passes.

The reverse staleness matters too: a heartbeat sampled while a request was in flight keeps
counting it after its prefill is done. A released request that a heartbeat had already counted
becomes a credit against that worker's reported load until its next heartbeat; without it, a
client sending one request at a time is steered away from the worker holding its prefix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import tandem.router.decision as d
from tandem.router.bus import EventBus, EventSubscription
from tandem.router.config import ROUND_ROBIN, RouterConfig
from tandem.router.decision import RoutingDecision
from tandem.router.errors import (
    BusReset,
    BusUnavailable,
    NoHealthyWorkers,
    RegistryUnavailable,
    SettingsMismatch,
)
from tandem.router.index import EventOrder, PrefixIndex
from tandem.router.registry import Clock, WorkerRecord, WorkerRegistry, settings_mismatch
from tandem.router.round_robin import RoundRobin
from tandem.router.sessions import SessionKey, Sessions
from tandem.services.protocol.block_hash import BlockHash, PromptHasher, hash_block

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterStatus:
    replica_id: str
    bus_connected: bool
    registry_connected: bool
    rebuilding: bool
    index_blocks: int
    indexed_workers: frozenset[str]
    workers: frozenset[str]
    refused: dict[str, str] = field(default_factory=dict)
    rebuilds: int = 0
    events_applied: int = 0
    event_gaps: int = 0  # times a worker's numbered KV events skipped ahead (then resynced)
    # Calls that found the chosen worker gone, per (role, reason): see ``mark_down``.
    failovers: dict[tuple[str, str], int] = field(default_factory=dict)
    # Decisions for requests of a session, per outcome (router/sessions.py: kept, moved, new),
    # and the sessions remembered now.
    session_routes: dict[str, int] = field(default_factory=dict)
    sessions: int = 0
    decisions: int = 0
    fallback_decisions: int = 0
    # Decisions per (reason, detail), as on RoutingDecision.
    decisions_by_reason: dict[tuple[str, str], int] = field(default_factory=dict)
    # Full blocks of the prompts sent to a prefill worker while the index was readable
    # (``prompt``), and of their leading blocks those cached on any prefill worker (``any``) and
    # on the chosen one (``chosen``): under any policy, what prefix routing could reach and did.
    prefix_blocks: dict[str, int] = field(default_factory=dict)


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Router:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        bus: EventBus | None = None,
        *,
        replica_id: str | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.config = config
        self.registry = registry
        self.bus = bus
        self.replica_id = replica_id or default_replica_id()
        self._clock = clock
        self.hasher = PromptHasher(config.settings, config.memo_blocks)
        self._index = PrefixIndex(config.settings.block_size, config.provisional_ttl_s)
        self._order = EventOrder()
        self._inflight = InFlight(config.inflight_max_age_s)
        self._rng = random.Random(config.seed)
        self._round_robin = RoundRobin()
        self._sessions = Sessions(config.session_ttl_s, config.max_sessions, config.session_slack)
        self._lock = threading.RLock()

        self._subscription: EventSubscription | None = (
            bus.subscribe(self.replica_id) if bus is not None else None
        )
        self._needs_open = True
        self._bus_ok = False
        self._rebuilding = bus is not None
        self._registry_ok = False
        self._settings_published = False
        self._workers: dict[str, WorkerRecord] = {}
        self._lapsed_since: dict[str, float] = {}
        self._forgotten: set[str] = set()
        self._refused: dict[str, str] = {}
        self._rebuilds = 0
        self._events_applied = 0
        self._decisions = 0
        self._fallbacks = 0
        self._by_reason: Counter[tuple[str, str]] = Counter()
        self._prefix_blocks: Counter[str] = Counter()
        self._failovers: Counter[tuple[str, str]] = Counter()
        self._down: dict[str, int] = {}  # worker -> heartbeat seq it was found gone at

        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._publish_settings(starting=True)

    # -- syncing with the cluster ------------------------------------------------------------

    def sync(self, block_s: float = 0.0, max_events: int = 100_000, registry: bool = True) -> None:
        """Pull pending KV events into the index and (if ``registry``) refresh the worker list.

        Never raises for an unreachable Redis: it records the outage, and the next call retries.
        """
        if self.bus is not None:
            self._sync_events(block_s, max_events)
        if registry:
            self._sync_registry()
        now = self._clock()
        with self._lock:
            self._index.expire(now)
            self._inflight.expire(now)
            lost = self._order.expire(now)
        if lost:  # a worker's missing KV events never came: it republishes its cache
            self._request_snapshots()

    def _sync_events(self, block_s: float, max_events: int) -> None:
        assert self.bus is not None and self._subscription is not None
        batch = min(max_events, 5000)
        try:
            if self._needs_open:
                self._subscription.open()
                with self._lock:
                    self._index.clear()
                    self._order.clear()
                    self._rebuilding = True
                    self._rebuilds += 1
                self._needs_open = False
                # Events published while we were away may be gone (or Redis restarted empty):
                # every worker republishes its whole cache.
                self.bus.request_snapshots()
            read = 0
            while read < max_events:
                events = self._subscription.read(batch, block_s if read == 0 else 0.0)
                now = self._clock()
                with self._lock:
                    for item in events:
                        for event in self._order.accept(item.worker_id, item.event, item.seq,
                                                        now):
                            self._index.apply(item.worker_id, event)
                            self._events_applied += 1
                read += len(events)
                if len(events) < batch:
                    with self._lock:
                        self._rebuilding = False
                    break
            if not self._bus_ok:
                log.info("router %s: event bus connected, index has %d blocks",
                         self.replica_id, self._index.confirmed_blocks)
            self._bus_ok = True
        except (BusUnavailable, BusReset) as exc:
            if self._bus_ok:
                log.warning("router %s: event bus lost (%s); routing by rendezvous hashing",
                            self.replica_id, exc)
            self._bus_ok = False
            self._needs_open = True

    def _sync_registry(self) -> None:
        try:
            if not self._settings_published:
                self._publish_settings()
            records = self.registry.workers()
        except RegistryUnavailable as exc:
            if self._registry_ok:
                log.warning("router %s: registry lost (%s); keeping the last %d workers",
                            self.replica_id, exc, len(self._workers))
            self._registry_ok = False
            self._settings_published = False  # Redis may come back empty
            return
        self._registry_ok = True
        now = self._clock()
        with self._lock:
            returned = self._apply_records(records, now)
        if returned:  # outside the lock: route() never waits on Redis
            self._request_snapshots()

    def _publish_settings(self, starting: bool = False) -> None:
        """Record the cluster's hash settings. A router whose settings differ from those already
        recorded refuses to start; a running one (Redis came back with other settings) logs."""
        try:
            self.registry.publish_settings(self.config.settings)
        except RegistryUnavailable:
            self._settings_published = False
            return
        except SettingsMismatch as exc:
            if starting:
                raise
            log.error("router %s: %s; workers with those settings will be refused",
                      self.replica_id, exc)
        self._settings_published = True

    def _apply_records(self, records: list[WorkerRecord], now: float) -> bool:
        """Take a registry snapshot. True if a forgotten worker came back (its entries were
        dropped, so it must republish its cache)."""
        live: dict[str, WorkerRecord] = {}
        returned = False
        for record in records:
            worker_id = record.worker_id
            reason = settings_mismatch(record.info, self.config.settings)
            if reason is None and record.info.role not in ("prefill", "decode"):
                reason = f"unknown role {record.info.role!r}"
            if reason is not None:
                if self._refused.get(worker_id) != reason:
                    log.error("router %s: refusing worker %s: %s", self.replica_id, worker_id,
                              reason)
                self._refused[worker_id] = reason
                continue
            self._refused.pop(worker_id, None)
            if worker_id in self._down:
                if self._down[worker_id] == record.heartbeat_seq:
                    continue  # found gone, and no heartbeat since
                del self._down[worker_id]
            previous = self._workers.get(worker_id)
            if previous is None or previous.heartbeat_seq != record.heartbeat_seq:
                self._inflight.reported(worker_id, record.updated_at)
            live[worker_id] = record
            self._lapsed_since.pop(worker_id, None)
            if worker_id in self._forgotten:
                self._forgotten.discard(worker_id)
                returned = True
        for worker_id in self._workers.keys() - live.keys():
            log.warning("router %s: worker %s lapsed; routing around it", self.replica_id,
                        worker_id)
            self._lapsed_since[worker_id] = now
        for worker_id, since in list(self._lapsed_since.items()):
            if now - since >= self.config.forget_lapsed_after_s:
                del self._lapsed_since[worker_id]
                self._index.remove_worker(worker_id)
                self._order.forget(worker_id)
                self._inflight.forget_worker(worker_id)
                self._forgotten.add(worker_id)
        self._workers = live
        return returned

    def _request_snapshots(self) -> None:
        if self.bus is None:
            return
        try:
            self.bus.request_snapshots()
        except BusUnavailable:
            self._needs_open = True  # the reopen requests them anyway

    # -- routing -----------------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        session: SessionKey | None = None,
    ) -> RoutingDecision:
        """Choose workers for a tokenized prompt (``session``: the request's, which keeps its
        decode worker while it can). Raises NoHealthyWorkers only when no worker of either
        role is known."""
        hashes = self.hasher.hashes(token_ids, cache_salt)
        key = rendezvous_key(
            hashes, self.config.fallback_prefix_blocks, token_ids,
            self.config.settings.extra_keys(cache_salt),
        )
        return self.route_hashes(hashes, len(token_ids), fallback_key=key, request_id=request_id,
                                 session=session)

    def route_hashes(
        self,
        hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        fallback_key: bytes | None = None,
        request_id: str | None = None,
        session: SessionKey | None = None,
    ) -> RoutingDecision:
        """``route`` for a caller that already has the prompt's block hashes."""
        if fallback_key is None:
            fallback_key = rendezvous_key(hashes, self.config.fallback_prefix_blocks,
                                          (num_tokens,))
        with self._lock:
            return self._decide(hashes, num_tokens, fallback_key,
                                request_id or uuid.uuid4().hex, session)

    def mark_down(self, worker_id: str, reason: str) -> None:
        """A call to the worker this router chose found it gone (e.g. its Serve replica was
        replaced): route around it until it heartbeats again, and count the failover."""
        with self._lock:
            record = self._workers.pop(worker_id, None)
            role = record.info.role if record is not None else "unknown"
            self._failovers[(role, reason)] += 1
            if record is not None:
                self._down[worker_id] = record.heartbeat_seq
                self._lapsed_since[worker_id] = self._clock()  # forgotten if it stays gone
                self._inflight.forget_worker(worker_id)
        log.warning("router %s: %s worker %s is gone (%s); failing over", self.replica_id, role,
                    worker_id, reason)

    def release(self, request_id: str) -> None:
        """The request's prefill is done (or it failed): stop counting it as pending load."""
        with self._lock:
            self._inflight.release(request_id)

    def _decide(
        self, hashes: Sequence[BlockHash], num_tokens: int, key: bytes, request_id: str,
        session: SessionKey | None,
    ) -> RoutingDecision:
        now = self._clock()
        cfg = self.config
        prefill = sorted(w for w, r in self._workers.items() if r.info.role == "prefill")
        decode = sorted(w for w, r in self._workers.items() if r.info.role == "decode")
        if not prefill and not decode:
            raise NoHealthyWorkers("no live prefill or decode worker is registered")
        prompt_blocks = -(-num_tokens // cfg.settings.block_size)
        if cfg.policy == ROUND_ROBIN:
            return self._decide_round_robin(prefill, decode, hashes, num_tokens, prompt_blocks,
                                            request_id, now)
        unusable = self._index_problem()
        host_blocks: dict[str, int] = {}
        lengths = (
            {} if unusable
            else self._index.prefix_lengths(hashes, prefill + decode, now, host_blocks)
        )
        decode_scores = {w: self._decode_load(w) for w in decode}
        self._decisions += 1

        skip_detail = None
        decode_choice: str | None = None
        if decode and not prefill:
            skip_detail = d.NO_PREFILL_WORKERS
        elif decode and num_tokens < cfg.short_prompt_tokens:
            skip_detail = d.SHORT_PROMPT
        elif decode and lengths and hashes and cfg.skip_prefill_when_cached_on_decode:
            most = cfg.max_local_prefill_tokens // cfg.settings.block_size  # uncached blocks
            holders = {w: decode_scores[w] for w in decode
                       if lengths[w] > 0 and len(hashes) - lengths[w] <= most}
            if holders:
                skip_detail = d.CACHED_ON_DECODE
                decode_choice = lowest(holders, key)
                if session is not None:  # among the holders, the session's worker if it may
                    decode_choice = self._sessions.choose(session, holders, decode_choice, now)
        if skip_detail is not None:
            if decode_choice is None:
                decode_choice = self._decode_choice(decode_scores, session, now)
            cached = lengths.get(decode_choice, 0)
            self._inflight.add(request_id, decode_choice, prompt_blocks, now)
            return self._decision(request_id, None, decode_choice, d.SKIP_PREFILL, skip_detail,
                                  num_tokens, prompt_blocks, cached, {}, decode_scores)

        if unusable is not None:
            self._fallbacks += 1
            weights = {w: rendezvous_weight(key, w) for w in prefill}
            chosen = rendezvous_choose(key, prefill)
            reason, detail, cached = d.FALLBACK, unusable, 0
            scores: dict[str, float] = weights
        else:
            scores = {
                w: prefill_cost(prompt_blocks, lengths[w], self._pending(w), cfg.miss_weight,
                                cfg.load_weight, host_blocks[w], cfg.host_hit_cost)
                for w in prefill
            }
            chosen = lowest(scores, key)
            cached = lengths[chosen]
            longest = max(lengths[w] for w in prefill)
            reason = d.PREFIX if cached > 0 and cached == longest else d.LOAD
            detail = ""
            self._count_prefix(len(hashes), longest, cached)
            # All of them, not only the uncached tail: a prefix that is only provisionally held
            # (its worker still queueing the first request) stays put while traffic keeps coming.
            self._index.add_provisional(chosen, hashes, now)
        self._inflight.add(request_id, chosen, prompt_blocks - cached, now)
        decode_choice = self._decode_choice(decode_scores, session, now) if decode else None
        if decode_choice is not None:
            self._inflight.add(request_id, decode_choice, prompt_blocks, now)
        return self._decision(request_id, chosen, decode_choice, reason, detail, num_tokens,
                              prompt_blocks, cached, scores, decode_scores)

    def _decide_round_robin(
        self, prefill: list[str], decode: list[str], hashes: Sequence[BlockHash],
        num_tokens: int, prompt_blocks: int, request_id: str, now: float,
    ) -> RoutingDecision:
        """Prefill workers in turn, never consulting the prefix index or their load; decode by
        load as under the prefix policy, so that a comparison isolates the prefill choice."""
        self._decisions += 1
        decode_scores = {w: self._decode_load(w) for w in decode}
        decode_choice = power_of_two(decode_scores, self._rng) if decode else None
        if decode_choice is not None:
            self._inflight.add(request_id, decode_choice, prompt_blocks, now)
        short = bool(decode) and num_tokens < self.config.short_prompt_tokens
        skip_detail = (d.NO_PREFILL_WORKERS if not prefill else d.SHORT_PROMPT if short
                       else None)
        if skip_detail is not None:
            return self._decision(request_id, None, decode_choice, d.SKIP_PREFILL, skip_detail,
                                  num_tokens, prompt_blocks, 0, {}, decode_scores)
        chosen = self._round_robin.next(prefill)
        if self._index_problem() in (None, d.INDEX_EMPTY):  # measured, never consulted
            lengths = self._index.prefix_lengths(hashes, prefill, now)
            self._count_prefix(len(hashes), max(lengths.values()), lengths[chosen])
        self._inflight.add(request_id, chosen, prompt_blocks, now)
        return self._decision(request_id, chosen, decode_choice, d.ROUND_ROBIN, "", num_tokens,
                              prompt_blocks, 0, {}, decode_scores)

    def _decode_choice(self, scores: dict[str, float], session: SessionKey | None,
                       now: float) -> str:
        """By load (power of two choices), or the session's worker while it may keep it."""
        usual = power_of_two(scores, self._rng)
        return usual if session is None else self._sessions.choose(session, scores, usual, now)

    def _count_prefix(self, prompt: int, any_worker: int, chosen: int) -> None:
        self._prefix_blocks.update(prompt=prompt, any=any_worker, chosen=chosen)

    def _index_problem(self) -> str | None:
        """Why the index cannot be trusted right now, or None if it can."""
        if self.bus is None or not self._bus_ok:
            return d.BUS_UNAVAILABLE
        if self._rebuilding:
            return d.INDEX_REBUILDING
        if self._index.confirmed_blocks == 0:
            return d.INDEX_EMPTY
        return None

    def _pending(self, worker_id: str) -> float:
        reported = self._workers[worker_id].load.pending_prefill_blocks
        stale = min(reported, self._inflight.credit(worker_id))
        return reported - stale + self._inflight.blocks(worker_id)

    def _decode_load(self, worker_id: str) -> float:
        record = self._workers[worker_id]
        capacity = max(record.info.capacity_blocks, 1)
        kv = record.load.kv_usage + self._inflight.blocks(worker_id) / capacity
        running = record.load.running_sequences + self._inflight.count(worker_id)
        return decode_score(kv, running, self.config.decode_kv_weight,
                            self.config.decode_running_weight)

    def _decision(
        self, request_id: str, prefill: str | None, decode: str | None, reason: str, detail: str,
        num_tokens: int, prompt_blocks: int, cached: int, prefill_scores: dict[str, float],
        decode_scores: dict[str, float],
    ) -> RoutingDecision:
        self._by_reason[reason, detail] += 1
        return RoutingDecision(
            request_id=request_id,
            prefill_worker=prefill,
            decode_worker=decode,
            reason=reason,
            detail=detail,
            prompt_tokens=num_tokens,
            prompt_blocks=prompt_blocks,
            cached_blocks=cached,
            prefill_address=self._workers[prefill].info.address if prefill else None,
            decode_address=self._workers[decode].info.address if decode else None,
            prefill_scores=prefill_scores,
            decode_scores=decode_scores,
        )

    # -- introspection and lifecycle ---------------------------------------------------------

    def workers(self) -> dict[str, WorkerRecord]:
        """The live, accepted workers of the last registry snapshot."""
        with self._lock:
            return dict(self._workers)

    def cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None
                      ) -> dict[str, int]:
        """Leading blocks of the prompt that each live worker holds, per the index."""
        hashes = self.hasher.hashes(token_ids, cache_salt)
        with self._lock:
            return self._index.prefix_lengths(hashes, self._workers, self._clock())

    def status(self) -> RouterStatus:
        with self._lock:
            return RouterStatus(
                replica_id=self.replica_id,
                bus_connected=self._bus_ok,
                registry_connected=self._registry_ok,
                rebuilding=self._rebuilding,
                index_blocks=self._index.confirmed_blocks,
                indexed_workers=frozenset(self._index.workers()),
                workers=frozenset(self._workers),
                refused=dict(self._refused),
                rebuilds=self._rebuilds,
                events_applied=self._events_applied,
                event_gaps=self._order.gaps,
                failovers=dict(self._failovers),
                session_routes=dict(self._sessions.routes),
                sessions=len(self._sessions),
                decisions=self._decisions,
                fallback_decisions=self._fallbacks,
                decisions_by_reason=dict(self._by_reason),
                prefix_blocks=dict(self._prefix_blocks),
            )

    def start(self, poll_s: float = 0.05, registry_every_s: float = 0.25,
              retry_s: float = 0.5) -> None:
        """Sync in a background thread: events continuously, the registry every
        ``registry_every_s``; after a failure, retry every ``retry_s``."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            last_registry = float("-inf")
            while not self._stop.is_set():
                now = time.monotonic()
                due = now - last_registry >= registry_every_s
                if due:
                    last_registry = now
                try:
                    self.sync(block_s=poll_s if self._bus_ok else 0.0, registry=due)
                except Exception:  # keep routing on a bug in one sync round
                    log.exception("router %s: sync failed", self.replica_id)
                if not (self._bus_ok or self.bus is None) or not self._registry_ok:
                    self._stop.wait(retry_s)
                elif self.bus is None:
                    self._stop.wait(poll_s)

        self._thread = threading.Thread(target=loop, name=f"router-sync-{self.replica_id}",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the background thread and drop this replica's consumer group."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._subscription is not None:
            self._subscription.close()


_TIE = 1e-9


def prefill_cost(
    prompt_blocks: int, cached_blocks: int, pending_blocks: float, miss_weight: float,
    load_weight: float, host_blocks: int = 0, host_hit_cost: float = 0.0,
) -> float:
    """``cached_blocks`` leading blocks are reused, ``host_blocks`` of them copied back from
    host memory at ``host_hit_cost`` of a miss each (a device hit costs nothing)."""
    uncached = prompt_blocks - cached_blocks + host_hit_cost * host_blocks
    return miss_weight * uncached + load_weight * pending_blocks


def decode_score(
    kv_usage: float, running_sequences: float, kv_weight: float, running_weight: float
) -> float:
    return kv_weight * kv_usage + running_weight * running_sequences


def lowest(scores: Mapping[str, float], tie_key: bytes) -> str:
    """Lowest score wins; ties go to the rendezvous winner for ``tie_key``, so every replica
    breaks a tie the same way while different prompts still spread across the tied workers."""
    best = min(scores.values())
    return rendezvous_choose(tie_key, (w for w, s in scores.items() if s <= best + _TIE))


def power_of_two(scores: Mapping[str, float], rng: random.Random) -> str:
    """Sample two candidates, keep the less loaded: near-best balance without herding every
    router onto the single least-loaded worker between heartbeats."""
    ids = sorted(scores)
    if len(ids) == 1:
        return ids[0]
    a, b = rng.sample(ids, 2)  # random order, so a tie goes to a random one of the two
    return a if scores[a] <= scores[b] else b


# -- Rendezvous hashing ------------------------------------------------------------------------
# Rendezvous (highest-random-weight) hashing: the fallback when no index can be trusted. Every
# router replica, given the same key and workers, picks the same worker, and removing one worker
# only moves the keys it owned.


_SCALE = float(1 << 64)


def rendezvous_key(
    hashes: Sequence[BlockHash],
    prefix_blocks: int,
    token_ids: Sequence[int] = (),
    extra_keys: Sequence[str] = (),
) -> bytes:
    """The key of a prompt: the chained hash of its first ``prefix_blocks`` blocks (which covers
    all of them), or, for a prompt shorter than one block, a hash of its tokens."""
    if hashes:
        return hashes[min(prefix_blocks, len(hashes)) - 1]
    return hash_block(None, token_ids, extra_keys)


def rendezvous_weight(key: bytes, worker_id: str) -> float:
    """Pseudo-random weight in [0, 1) of ``worker_id`` for ``key``, identical in every process."""
    digest = hashlib.blake2b(key + b"\x00" + worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE


def rendezvous_choose(key: bytes, workers: Iterable[str]) -> str:
    """The worker with the highest weight for ``key``; ``workers`` must not be empty."""
    return max(workers, key=lambda w: (rendezvous_weight(key, w), w))


@dataclass(frozen=True)
class _Assignment:
    request_id: str
    worker_id: str
    assigned_at: float
    blocks: int  # prefill: blocks to compute; decode: prompt blocks to hold


class InFlight:
    """Not thread-safe on its own; the router serialises access."""

    def __init__(self, max_age_s: float = 30.0) -> None:
        self.max_age_s = max_age_s
        self._by_worker: dict[str, list[_Assignment]] = defaultdict(list)
        self._by_request: dict[str, list[_Assignment]] = defaultdict(list)
        self._blocks: dict[str, int] = defaultdict(int)
        # Assignments a worker's heartbeat has counted and the caller has not released yet.
        self._reported: dict[str, list[_Assignment]] = defaultdict(list)
        self._credit: dict[str, int] = defaultdict(int)  # released since the last heartbeat

    def add(self, request_id: str, worker_id: str, blocks: int, now: float) -> None:
        entry = _Assignment(request_id, worker_id, now, blocks)
        self._by_worker[worker_id].append(entry)
        self._by_request[request_id].append(entry)
        self._blocks[worker_id] += blocks

    def release(self, request_id: str) -> None:
        for entry in self._by_request.pop(request_id, ()):
            self._remove_from_worker(entry.worker_id, lambda e, target=entry: e is target)
        for counted in self._reported.pop(request_id, ()):
            self._credit[counted.worker_id] += counted.blocks

    def reported(self, worker_id: str, heartbeat_at: float) -> None:
        """The worker's load sampled at ``heartbeat_at`` already includes earlier assignments."""
        self._credit.pop(worker_id, None)
        self._remove_from_worker(worker_id, lambda e: e.assigned_at <= heartbeat_at, unlink=True,
                                 counted=True)

    def credit(self, worker_id: str) -> int:
        """Blocks the worker's last heartbeat counted for requests released since."""
        return self._credit.get(worker_id, 0)

    def expire(self, now: float) -> None:
        for worker_id in list(self._by_worker):
            self._remove_from_worker(
                worker_id, lambda e: now - e.assigned_at > self.max_age_s, unlink=True
            )
        self._drop_reported(lambda e: now - e.assigned_at > self.max_age_s)

    def blocks(self, worker_id: str) -> int:
        return self._blocks.get(worker_id, 0)

    def count(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def forget_worker(self, worker_id: str) -> None:
        self._remove_from_worker(worker_id, lambda e: True, unlink=True)
        self._credit.pop(worker_id, None)
        self._drop_reported(lambda e: e.worker_id == worker_id)

    def _drop_reported(self, drop: Callable[[_Assignment], bool]) -> None:
        for request_id, entries in list(self._reported.items()):
            entries[:] = [e for e in entries if not drop(e)]
            if not entries:
                del self._reported[request_id]

    def _remove_from_worker(
        self, worker_id: str, drop: Callable[[_Assignment], bool], unlink: bool = False,
        counted: bool = False,
    ) -> None:
        entries = self._by_worker.get(worker_id)
        if not entries:
            return
        keep = []
        for entry in entries:
            if not drop(entry):
                keep.append(entry)
                continue
            self._blocks[worker_id] -= entry.blocks
            if counted:
                self._reported[entry.request_id].append(entry)
            if unlink:
                siblings = self._by_request.get(entry.request_id)
                if siblings is not None:
                    siblings[:] = [e for e in siblings if e is not entry]
                    if not siblings:
                        del self._by_request[entry.request_id]
        if keep:
            self._by_worker[worker_id] = keep
        else:
            del self._by_worker[worker_id]
            self._blocks.pop(worker_id, None)
