"""The prefill-to-decode hand-off's messages: ``KVHandle``, the ticket a prefill worker hands
out for a prompt's pinned KV blocks, and ``PrefillResult``, the first token with that ticket
(it rides to the decode worker in ``GenerationRequest.prefill``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tandem.services.protocol.auth import ClusterKey
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
