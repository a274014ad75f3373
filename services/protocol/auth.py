"""The cluster secret between workers: who may talk to a worker, and which lease handles to trust.

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
from pathlib import Path
from typing import Any

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
