"""Pairing guard: a prefill and a decode worker agree on everything their KV bytes depend on.

Checked once, when a decode worker meets a prefill worker (both sides check), so a mismatch is
a clear error at start-up instead of garbage tokens later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from tandem.services.protocol.block_hash import HASH_SCHEME

if TYPE_CHECKING:
    from tandem.services.engine.llm_engine import LLMEngine
    from tandem.services.kv_transfer.transport import KVTransport
    from tandem.services.protocol.handoff import ClusterKey

PROTOCOL_VERSION = 1
# The engine's cache layout (services/engine/kv_cache.py), named so a change is noticed. Blocks
# cross the wire in it with every KV head, whatever either side's tensor_parallel_size (a
# tensor-parallel engine's kv_spec is this canonical layout; it stages blocks in it).
KV_LAYOUT = "block-major[block,layer,k|v,slot,kv_head,head_dim]"


class PairingError(ValueError):
    """Two workers cannot exchange KV blocks."""


@dataclass(frozen=True)
class PairingInfo:
    worker_id: str
    role: str  # "prefill" | "decode"
    model_id: str
    dtype: str
    block_size: int
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_scheme: str
    transport: str
    protocol_version: int = PROTOCOL_VERSION
    kv_cache_dtype: str = "auto"  # auto: the cache holds `dtype`; int8: values + their scales
    transport_metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    # Signed with the cluster key by its worker (None without a key): the transport metadata
    # is what a NIXL peer needs to read this worker's cache.
    mac: str | None = field(default=None, compare=False)

    @classmethod
    def for_engine(cls, engine: LLMEngine, worker_id: str, role: str,
                   transport: KVTransport) -> PairingInfo:
        spec = engine.kv_spec
        return cls(worker_id=worker_id, role=role, model_id=engine.model_config.model_id,
                   dtype=spec.dtype, kv_cache_dtype=spec.kv_dtype,
                   block_size=spec.block_size, kv_layout=KV_LAYOUT,
                   num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, hash_scheme=HASH_SCHEME, transport=transport.kind,
                   transport_metadata=transport.metadata())

    def content(self) -> dict[str, Any]:
        """What the MAC covers: everything but itself."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "mac"}

    def signed(self, key: ClusterKey | None) -> PairingInfo:
        return self if key is None else replace(self, mac=key.sign("pairing", self.content()))

    def check_signed(self, key: ClusterKey | None) -> None:
        """Raise ``PairingError`` unless a worker holding the cluster secret wrote this."""
        if key is not None and not key.verify(self.mac, "pairing", self.content()):
            raise PairingError(f"{self.role} worker {self.worker_id!r}: its pairing info is not "
                               f"signed with this cluster's secret")

    def to_dict(self) -> dict[str, Any]:
        return {**self.content(), "mac": self.mac}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairingInfo:
        try:
            info = cls(**data)
        except TypeError as exc:
            raise PairingError(f"malformed pairing info: {exc}") from None
        if info.mac is not None and not isinstance(info.mac, str):
            raise PairingError(f"malformed pairing info: mac={info.mac!r}")
        for f in fields(cls):
            if f.name == "mac":
                continue
            expected = dict if f.name == "transport_metadata" else f.type
            value = getattr(info, f.name)
            ok = isinstance(value, dict) if expected is dict else (
                type(value) is int if expected == "int" else isinstance(value, str))
            if not ok:
                raise PairingError(f"malformed pairing info: {f.name}={value!r}")
        return info


# Field, what to call it in an error message.
_MUST_MATCH = (
    ("protocol_version", "protocol version"),
    ("model_id", "model"),
    ("dtype", "dtype"),
    ("kv_cache_dtype", "KV cache dtype (kv_cache_dtype)"),
    ("block_size", "block size"),
    ("kv_layout", "KV cache layout"),
    ("num_layers", "KV cache layout (layers)"),
    ("num_kv_heads", "KV cache layout (KV heads)"),
    ("head_dim", "KV cache layout (head dim)"),
    ("hash_scheme", "block hash scheme"),
    ("transport", "KV transport"),
)


def check_pairing(local: PairingInfo, remote: PairingInfo) -> None:
    """Raise ``PairingError`` naming every setting on which the two workers differ."""
    problems = []
    if {local.role, remote.role} != {"prefill", "decode"}:
        problems.append(f"roles are {local.role} and {remote.role}; one prefill and one decode "
                        f"worker pair")
    for name, label in _MUST_MATCH:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            problems.append(f"{label} differs ({local.worker_id}: {mine!r}, "
                            f"{remote.worker_id}: {theirs!r})")
    if problems:
        raise PairingError(f"cannot pair {local.role} worker {local.worker_id!r} with "
                           f"{remote.role} worker {remote.worker_id!r}: " + "; ".join(problems))
