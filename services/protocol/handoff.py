"""The prefill-to-decode hand-off's messages: ``KVHandle``, the ticket a prefill worker hands
out for a prompt's pinned KV blocks, and ``PrefillResult``, the first token with that ticket
(it rides to the decode worker in ``GenerationRequest.prefill``); and the cluster secret
between workers that guards it: who may talk to a worker, and which lease handles to trust.

Every worker and the gateway read one secret (``cluster_secret_file``; ``tandem up`` makes one
per run, the Helm chart mounts one from a Secret). From it:

- **Handshake.** A connection to a worker's control port or KV port starts with a
  challenge-response: the server sends a random nonce, the client answers with its own nonce,
  its name and an HMAC of both nonces, the channel and the name; the server answers with its
  HMAC of the same, so each side knows the other holds the secret. The secret never crosses
  the wire and a recorded handshake cannot be replayed (fresh nonces). A connection whose
  handshake fails is closed before any request is read: nothing is pinned, nothing is read.
- **Signed messages.** A lease handle (who holds which blocks, for which decode worker) and a
  worker's pairing info (its cache layout and transport address, which NIXL needs to read
  from it) carry an HMAC of their content, so a worker acts only on ones a worker of this
  cluster wrote, unaltered (``sign`` / ``verify``).

Purposes are separated (a MAC made for one use is not valid for another). The secret is read
from a file, never from the command line or an environment variable, and never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.services.protocol.outputs import TokenLogprobs


@dataclass(frozen=True)
class KVHandle:
    """Which blocks to pull from which prefill worker, under which lease, by which reader;
    signed by the prefill worker with the cluster key (``mac``; None without a key)."""

    worker_id: str  # the prefill worker holding the blocks
    lease_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks in order; the last may be partly filled
    num_tokens: int  # prompt tokens whose KV the blocks hold
    checksums: tuple[int, ...] | None = None  # CRC32 per block (debug mode)
    reader: str | None = None  # the decode worker the lease was offered to; None: any
    mac: str | None = None

    def content(self) -> dict[str, Any]:
        """What the MAC covers: everything but itself."""
        return {"worker_id": self.worker_id, "lease_id": self.lease_id,
                "block_ids": list(self.block_ids), "num_tokens": self.num_tokens,
                "checksums": None if self.checksums is None else list(self.checksums),
                "reader": self.reader}

    def signed(self, key: ClusterKey | None) -> KVHandle:
        return self if key is None else replace(self, mac=key.sign("kv-handle", self.content()))

    def verified(self, key: ClusterKey | None) -> bool:
        return key is None or key.verify(self.mac, "kv-handle", self.content())

    def to_dict(self) -> dict[str, Any]:
        return {**self.content(), "mac": self.mac}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandle:
        worker_id, lease_id = data.get("worker_id"), data.get("lease_id")
        block_ids, num_tokens = data.get("block_ids"), data.get("num_tokens")
        checksums, reader, mac = data.get("checksums"), data.get("reader"), data.get("mac")
        if not (isinstance(worker_id, str) and isinstance(lease_id, str)
                and _ints(block_ids) and type(num_tokens) is int and num_tokens > 0
                and (checksums is None or (_ints(checksums)
                                           and len(checksums) == len(block_ids)))
                and (reader is None or isinstance(reader, str))
                and (mac is None or isinstance(mac, str))):
            raise ValueError(f"malformed KV handle: {data!r}")
        return cls(worker_id, lease_id, tuple(block_ids), num_tokens,
                   None if checksums is None else tuple(checksums), reader, mac)


def _ints(values: object) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


@dataclass(frozen=True)
class PrefillResult:
    """The first token, and (unless the request already finished) a handle on the KV."""

    request_id: str
    first_token: int
    finish_reason: str | None  # set when the request ended at its first token
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefill worker found in its prefix cache
    kv: KVHandle | None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # SamplingParams.prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "first_token": self.first_token,
                "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens,
                "kv": None if self.kv is None else self.kv.to_dict(),
                "logprobs": [lp.to_dict() for lp in self.logprobs],
                "prompt_logprobs": None if self.prompt_logprobs is None
                else [lp.to_dict() for lp in self.prompt_logprobs]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillResult:
        try:
            kv = data.get("kv")
            return cls(str(data["request_id"]), int(data["first_token"]),
                       None if data["finish_reason"] is None else str(data["finish_reason"]),
                       int(data["num_prompt_tokens"]), int(data["num_cached_tokens"]),
                       None if kv is None else KVHandle.from_dict(kv),
                       tuple(TokenLogprobs.from_dict(lp) for lp in data.get("logprobs", [])),
                       None if data.get("prompt_logprobs") is None
                       else tuple(TokenLogprobs.from_dict(lp) for lp in data["prompt_logprobs"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed prefill result: {exc!r}") from None


log = logging.getLogger(__name__)

MIN_SECRET_CHARS = 32
HANDSHAKE_TIMEOUT_S = 5.0
_VERSION = "tandem-auth-1"

SendFrame = Callable[[dict[str, Any]], Awaitable[None]]
RecvFrame = Callable[[], Awaitable[dict[str, Any] | None]]


class ClusterSecretError(ValueError):
    """The cluster secret file is missing, unreadable or too short."""


class AuthError(ConnectionError):
    """A peer did not prove it holds the cluster secret (or a signature did not match)."""


def read_secret(path: str | Path) -> bytes:
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ClusterSecretError(f"cannot read cluster_secret_file {path}: {exc.strerror}"
                                 ) from None
    if len(secret) < MIN_SECRET_CHARS:
        raise ClusterSecretError(f"cluster_secret_file {path}: the secret must have at least "
                                 f"{MIN_SECRET_CHARS} characters")
    return secret.encode()


class ClusterKey:
    """MACs keyed by the cluster secret, one derived key per purpose."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ClusterSecretError(f"the cluster secret must have at least {MIN_SECRET_CHARS} "
                                     f"characters")
        self._secret = secret
        self._keys: dict[str, bytes] = {}  # purpose -> its derived key

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterKey:
        return cls(read_secret(path))

    def __repr__(self) -> str:
        return "ClusterKey(<secret>)"

    def mac(self, purpose: str, *parts: str) -> str:
        key = self._keys.get(purpose)
        if key is None:
            key = hmac.new(self._secret, f"{_VERSION}/{purpose}".encode(),
                           hashlib.sha256).digest()
            self._keys[purpose] = key
        message = json.dumps(parts, separators=(",", ":")).encode()  # unambiguous framing
        return hmac.new(key, message, hashlib.sha256).hexdigest()

    def check(self, mac: object, purpose: str, *parts: str) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(mac, self.mac(purpose, *parts))

    def sign(self, purpose: str, content: dict[str, Any]) -> str:
        """The MAC of a JSON object's canonical form."""
        return self.mac(purpose, json.dumps(content, sort_keys=True, separators=(",", ":")))

    def verify(self, mac: object, purpose: str, content: dict[str, Any]) -> bool:
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return self.check(mac, purpose, canonical)


async def accept(key: ClusterKey, channel: str, send: SendFrame, recv: RecvFrame) -> str:
    """The server's side of the handshake; returns the name the client proved it holds the
    secret under. Raises ``AuthError`` (after telling the client why) or ``TimeoutError``."""
    nonce = secrets.token_hex(16)
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        await send({"hello": _VERSION, "nonce": nonce})
        reply = await recv()
        auth = reply.get("auth") if reply is not None else None
        if not isinstance(auth, dict) or not all(
                isinstance(auth.get(k), str) for k in ("peer", "nonce", "mac")):
            error = "unauthenticated: the connection must start with the cluster handshake"
        elif not key.check(auth["mac"], "client", channel, nonce, auth["nonce"], auth["peer"]):
            error = "unauthenticated: the handshake does not prove the cluster secret"
        else:
            await send({"auth_ok": key.mac("server", channel, nonce, auth["nonce"],
                                           auth["peer"])})
            return str(auth["peer"])
        await send({"ok": False, "error": error})
    raise AuthError(error)


async def connect(key: ClusterKey, channel: str, name: str, send: SendFrame,
                  recv: RecvFrame) -> None:
    """The client's side: prove the secret under ``name``, and check the server holds it too.
    Raises ``AuthError``."""
    unkeyed = (f"the peer did not start the {_VERSION} handshake (does it run without the "
               f"cluster secret?)")
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            hello = await recv()
            if hello is None or hello.get("hello") != _VERSION or not isinstance(
                    hello.get("nonce"), str):
                raise AuthError(unkeyed)
            nonce = secrets.token_hex(16)
            await send({"auth": {"peer": name, "nonce": nonce, "mac": key.mac(
                "client", channel, hello["nonce"], nonce, name)}})
            reply = await recv()
    except TimeoutError:
        raise AuthError(f"{unkeyed}; nothing within {HANDSHAKE_TIMEOUT_S:g} s") from None
    if reply is None or not key.check(reply.get("auth_ok"), "server", channel,
                                      hello["nonce"], nonce, name):
        why = reply.get("error") if reply is not None else "it closed the connection"
        raise AuthError(f"the peer refused or failed the handshake: {why}")
