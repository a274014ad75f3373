from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.services.control.codec import logprobs_from_dict, logprobs_to_dict
from tandem.services.engine.sequence import TokenLogprobs
from tandem.services.kv_transfer.handle import KVHandle


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
                "logprobs": [logprobs_to_dict(lp) for lp in self.logprobs],
                "prompt_logprobs": None if self.prompt_logprobs is None
                else [logprobs_to_dict(lp) for lp in self.prompt_logprobs]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillResult:
        try:
            kv = data.get("kv")
            return cls(str(data["request_id"]), int(data["first_token"]),
                       None if data["finish_reason"] is None else str(data["finish_reason"]),
                       int(data["num_prompt_tokens"]), int(data["num_cached_tokens"]),
                       None if kv is None else KVHandle.from_dict(kv),
                       tuple(logprobs_from_dict(lp) for lp in data.get("logprobs", [])),
                       None if data.get("prompt_logprobs") is None
                       else tuple(logprobs_from_dict(lp) for lp in data["prompt_logprobs"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed prefill result: {exc!r}") from None
