"""Tenants: who a request's API key belongs to, the prefix-cache salt that keeps tenants apart,
and per-tenant rate limits.

- Keys come from a file (``api_keys_file``) of ``tenant:key`` lines (a bare ``key`` belongs to
  tenant ``default``); blank lines and ``#`` comments are skipped. No keys: no authentication,
  and every request is tenant ``default``. The file is looked at again every
  ``KEYS_RELOAD_S`` while running: a key taken out is refused from then on, one added works; a
  file that no longer parses is logged and the keys in force kept.
- The cache salt a request's blocks are hashed with is derived on the server: an HMAC, keyed by
  the cluster secret, of the tenant and the client's own ``cache_salt``. A client's salt only
  subdivides its tenant's cache, so one tenant can neither hit another's cached prompts nor learn
  from ``cached_tokens`` (or TTFT) that they are cached.
- Rate limits (``tenant_requests_per_minute``, ``tenant_tokens_per_minute``) are token buckets
  per tenant that refill continuously. A request is charged its prompt plus its ``max_tokens``
  when it is admitted and refunded what it did not generate when it ends; one over either limit
  gets 429 with Retry-After and never reaches a worker. A request larger than the whole token
  bucket can never fit and is refused at once, naming both figures.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tandem.services.gateway.errors import GatewayError, overloaded, unauthorized
from tandem.services.protocol.request import DEFAULT_TENANT, UNKNOWN_TENANT

log = logging.getLogger(__name__)

KEYS_RELOAD_S = 2.0  # how often a running gateway looks at its keys file again


class TenantConfigError(ValueError):
    """A malformed keys file or secret; the message says where."""


def parse_api_keys(text: str, source: str = "api keys") -> dict[str, str]:
    """``tenant:key`` lines -> {key: tenant} (a line's ``weight=N`` is ``tenant_weights``')."""
    return {key: tenant for key, (tenant, _) in _key_lines(text, source).items()}


def tenant_weights(text: str, source: str = "api keys") -> dict[str, float]:
    """Each tenant's admission weight (``tenant:key weight=N``; 1 unless a line says)."""
    weights: dict[str, float] = {}
    for tenant, weight in _key_lines(text, source).values():
        if weight is not None:
            if weights.get(tenant, weight) != weight:
                raise TenantConfigError(f"{source}: tenant {tenant!r} has two weights")
            weights[tenant] = weight
    return weights


def _key_lines(text: str, source: str) -> dict[str, tuple[str, float | None]]:
    """``tenant:key [weight=N]`` lines -> {key: (tenant, weight or None)}."""
    keys: dict[str, tuple[str, float | None]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, rest = line.rpartition(":")
        tenant = tenant.strip() if sep else DEFAULT_TENANT
        key, *options = rest.split() or [""]
        weight = None
        for option in options:
            name, _, value = option.partition("=")
            try:
                weight = float(value) if name == "weight" else None
            except ValueError:
                weight = None
            if weight is None or not weight > 0 or not math.isfinite(weight):
                raise TenantConfigError(f"{source} line {number}: expected tenant:key "
                                        f"[weight=N], N > 0")
        if not key or not tenant:
            raise TenantConfigError(f"{source} line {number}: expected tenant:key")
        if tenant == UNKNOWN_TENANT:
            raise TenantConfigError(f"{source} line {number}: the tenant name {UNKNOWN_TENANT!r} "
                                    f"is reserved (refused requests' metrics label)")
        if key in keys:
            raise TenantConfigError(f"{source} line {number}: a key is listed twice")
        keys[key] = (tenant, weight)
    return keys


def read_tenant_weights(path: str | Path) -> dict[str, float]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TenantConfigError(f"cannot read api_keys_file {path}: {exc.strerror}") from None
    return tenant_weights(text, str(path))


def read_api_keys(path: str | Path) -> dict[str, str]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TenantConfigError(f"cannot read api_keys_file {path}: {exc.strerror}") from None
    keys = parse_api_keys(text, str(path))
    if not keys:
        raise TenantConfigError(f"api_keys_file {path} holds no key")
    return keys


def _stamp(path: Path) -> tuple[float, int, int] | None:
    """What tells a changed keys file (a Secret's update swaps a symlink: a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime, st.st_size, st.st_ino


def rate_limited(tenant: str, what: str, retry_after_s: int) -> GatewayError:
    return GatewayError(429, f"Rate limit reached for tenant {tenant!r}: {what}. Retry after "
                             f"{retry_after_s} s.", type="rate_limit_error",
                        code="rate_limit_exceeded", retry_after_s=retry_after_s)


@dataclass
class _Bucket:
    """Holds up to ``per_minute`` units and refills at ``per_minute`` a minute."""

    per_minute: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute,
                         self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` (at most a full bucket) fits."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * 60.0 / self.per_minute


@dataclass
class Tenants:
    """API keys, tenants' cache salts and rate limits (thread-safe)."""

    keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant; empty: no auth
    secret: bytes = b""  # keys the cache salts; empty: a client's salt is used as given
    requests_per_minute: int | None = None  # per tenant; None: no limit
    tokens_per_minute: int | None = None  # prompt + max_tokens, per tenant; None: no limit
    clock: Callable[[], float] = time.monotonic
    # Admission weights under contention (FairSlots; the keys file's weight=N; 1 if unset)
    weights: Mapping[str, float] = field(default_factory=dict)
    keys_file: Path | None = None  # where ``keys`` and ``weights`` came from: reread on change
    _keys_seen: tuple[float, int, int] | None = field(default=None, repr=False)
    _keys_checked: float = field(default=0.0, repr=False)
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TenantConfigError(f"tenant_{name} must be >= 1, got {value}")
        if self.keys and not self.secret:
            raise TenantConfigError("API keys need a cluster secret (it keys the tenants' "
                                    "cache salts)")
        if self.keys_file is not None:
            self._keys_seen = _stamp(self.keys_file)
            self._keys_checked = self.clock()

    def reload_keys(self) -> bool:
        """Read ``keys_file`` again if it changed since last read (looked at most every
        KEYS_RELOAD_S; the gateway calls this as it authenticates). True when the keys in force
        changed."""
        now = self.clock()
        if self.keys_file is None or now - self._keys_checked < KEYS_RELOAD_S:
            return False
        self._keys_checked = now
        stamp = _stamp(self.keys_file)
        if stamp == self._keys_seen:
            return False
        self._keys_seen = stamp
        try:
            keys = read_api_keys(self.keys_file)
            weights = read_tenant_weights(self.keys_file)
        except TenantConfigError as exc:
            log.error("api_keys_file changed but cannot be used, keeping the %d key(s) in "
                      "force: %s", len(self.keys), exc)
            return False
        self.keys, self.weights = keys, weights
        log.info("api_keys_file reloaded: %d key(s) for tenants %s", len(keys),
                 ", ".join(self.tenant_names))
        return True

    @property
    def in_use(self) -> bool:
        """Whether any key, secret or limit is set (otherwise every request is the default
        tenant's, with its client's salt, unlimited: the gateway skips this class)."""
        return bool(self.keys or self.secret or self.requests_per_minute is not None
                    or self.tokens_per_minute is not None)

    @property
    def tenant_names(self) -> list[str]:
        return sorted(set(self.keys.values())) or [DEFAULT_TENANT]

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of ``Authorization: Bearer <key>`` (401 if wrong or missing); without
        keys, the default tenant."""
        if not self.keys:
            return DEFAULT_TENANT
        scheme, _, given = (authorization or "").partition(" ")
        key = given.strip().encode()
        tenant = None
        for known, owner in self.keys.items():  # every key compared: timing tells nothing
            if hmac.compare_digest(key, known.encode()):
                tenant = owner
        if scheme.lower() != "bearer" or tenant is None:
            raise unauthorized()
        return tenant

    def cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The salt the request's blocks are hashed with."""
        if not self.secret:
            return client_salt or None
        message = f"{tenant}\0{client_salt or ''}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def admit(self, tenant: str, tokens: int) -> int:
        """Charge one request of ``tokens`` (prompt + max_tokens) to ``tenant``; 429 if either
        limit is reached (nothing charged). Returns the tokens charged (for ``settle``)."""
        limits = [("requests", self.requests_per_minute, 1),
                  ("tokens", self.tokens_per_minute, tokens)]
        limits = [(what, per_minute, amount) for what, per_minute, amount in limits
                  if per_minute is not None]
        if not limits:
            return 0
        if self.tokens_per_minute is not None and tokens > self.tokens_per_minute:
            raise GatewayError(429, f"Request too large for tenant {tenant!r}: its prompt and "
                                    f"max_tokens come to {tokens} tokens, over the tenant's "
                                    f"{self.tokens_per_minute} tokens per minute; send a "
                                    f"shorter prompt or a smaller max_tokens.",
                               type="rate_limit_error", code="request_too_large")
        now = self.clock()
        with self._lock:
            buckets = [(what, self._bucket(tenant, what, per_minute, now), amount)
                       for what, per_minute, amount in limits]
            for what, bucket, amount in buckets:
                wait = bucket.wait_s(amount)
                if wait > 0:
                    raise rate_limited(tenant, f"{bucket.per_minute:g} {what} per minute",
                                       max(1, math.ceil(wait)))
            for _, bucket, amount in buckets:
                bucket.level -= amount
        return tokens if self.tokens_per_minute else 0

    def settle(self, tenant: str, charged: int, used: int) -> None:
        """A request charged ``charged`` tokens ended having used ``used``: refund the rest."""
        refund = charged - min(used, charged)
        if refund <= 0 or self.tokens_per_minute is None:
            return
        with self._lock:
            bucket = self._buckets.get((tenant, "tokens"))
            if bucket is not None:
                bucket.level = min(bucket.per_minute, bucket.level + refund)

    def _bucket(self, tenant: str, what: str, per_minute: int, now: float) -> _Bucket:
        bucket = self._buckets.get((tenant, what))
        if bucket is None:
            bucket = self._buckets[(tenant, what)] = _Bucket(per_minute, per_minute, now)
        bucket.refill(now)
        return bucket


class FairSlots:
    """The gateway's ``max_in_flight`` admission slots, fair across tenants when they run out.

    A request takes any free slot. When none is free, a tenant below its share (the limit split
    by weight among the tenants with requests in flight or waiting) waits for the next slot
    that frees (the tenant with the fewest in flight per weight first), and one at or over its
    share is refused at once (429). No tenant holds more than its cap (``tenant_cap``; by
    default, with several tenants configured, the limit less a quarter): the rest stays free
    for the others, whose requests are then admitted at once however hard one tenant floods
    (it keeps getting 429s). Runs on the gateway's event loop."""

    def __init__(self, limit: int, weights: Mapping[str, float] | None = None,
                 retry_after_s: int = 1, tenant_cap: int | None = None,
                 tenants: int = 1) -> None:
        """``tenants``: how many the keys file names (one: no default cap)."""
        self.limit = limit
        self.weights = dict(weights or {})
        self.retry_after_s = retry_after_s
        self.tenant_cap = tenant_cap
        self.tenants = tenants
        self.in_flight: dict[str, int] = {}
        self.total = 0
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    def cap(self) -> int:
        """The most requests one tenant may have in flight."""
        if self.tenant_cap is not None:
            return self.tenant_cap
        return self.limit if self.tenants < 2 else max(1, self.limit - max(1, self.limit // 4))

    def share(self, tenant: str) -> float:
        """``tenant``'s slots under contention."""
        active = {t for t, n in self.in_flight.items() if n} | {
            t for t, q in self._waiting.items() if q} | {tenant}
        return self.limit * self._weight(tenant) / sum(self._weight(t) for t in active)

    async def acquire(self, tenant: str, timeout_s: float | None = None) -> None:
        """A slot for one request of ``tenant``: at once, after waiting its turn (at most
        ``timeout_s``), or 429."""
        self.check(tenant)
        if self.total < self.limit and not any(self._waiting.values()):
            self._take(tenant)
            return
        queued = self._waiting.setdefault(tenant, deque())
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queued.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), timeout_s)
        except TimeoutError:
            if self._withdraw(tenant, turn):
                raise overloaded(f"no slot freed within the request's deadline ({self.total} "
                                 f"in flight, the limit is {self.limit})",
                                 self.retry_after_s) from None
        except BaseException:  # cancelled: the client left
            if not self._withdraw(tenant, turn):
                self.release(tenant)  # a slot came as it left: pass it on
            raise

    def check(self, tenant: str) -> None:
        """429 if ``acquire`` would refuse ``tenant`` now (at its cap, or over its share with
        no slot free): the gateway asks before it parses or tokenizes a request."""
        held = self.in_flight.get(tenant, 0) + len(self._waiting.get(tenant, ()))
        cap = self.cap()
        if held >= cap:
            raise overloaded(f"tenant {tenant!r} has {held} requests in flight or waiting, its "
                             f"cap ({cap} of the {self.limit} slots: the rest are kept for "
                             f"other tenants)", self.retry_after_s)
        contended = self.total >= self.limit or any(self._waiting.values())
        if contended and held >= self.share(tenant):
            raise overloaded(f"{self.total} requests are in flight, the limit is {self.limit}, "
                             f"and tenant {tenant!r} holds its share of them",
                             self.retry_after_s)

    def _withdraw(self, tenant: str, turn: asyncio.Future[None]) -> bool:
        """Take ``turn`` out of the queue; False when it was handed a slot already."""
        if turn.done():
            return False
        turn.cancel()
        self._waiting[tenant].remove(turn)
        return True

    def release(self, tenant: str) -> None:
        """One of ``tenant``'s requests ended: its slot goes to the next in turn."""
        self.in_flight[tenant] -= 1
        self.total -= 1
        self._hand_out()

    def resize(self, limit: int) -> None:
        """A new bound (the healthy decode workers changed): more slots go to those waiting at
        once; fewer take effect as requests end."""
        self.limit = limit
        self._hand_out()

    def _hand_out(self) -> None:
        while self.total < self.limit:
            cap = self.cap()
            waiting = [t for t, q in self._waiting.items()
                       if q and self.in_flight.get(t, 0) < cap]
            if not waiting:
                return
            nxt = min(waiting, key=lambda t: self.in_flight.get(t, 0) / self._weight(t))
            turn = self._waiting[nxt].popleft()
            self._take(nxt)
            turn.set_result(None)

    def _take(self, tenant: str) -> None:
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        self.total += 1

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)
