"""JSON forms of the request and its parameters, for the control channel of workers run without
Ray (their other messages carry their own ``to_dict`` / ``from_dict``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.services.protocol.handoff import PrefillResult
from tandem.services.protocol.request import GenerationRequest, SamplingParams


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    data = dataclasses.asdict(params)
    data["stop_token_ids"] = list(params.stop_token_ids)
    return data


def params_from_dict(data: Any) -> SamplingParams:
    """Validated by SamplingParams itself; unknown fields are an error."""
    if not isinstance(data, dict):
        raise ValueError("sampling params must be a JSON object")
    try:
        return SamplingParams(**data)
    except TypeError as exc:
        raise ValueError(f"bad sampling params: {exc}") from None


def token_ids(data: Any, what: str = "prompt") -> list[int]:
    if not isinstance(data, list) or not all(type(t) is int for t in data):
        raise ValueError(f"{what} must be a list of token ids")
    return data


def request_to_dict(request: GenerationRequest) -> dict[str, Any]:
    """What a worker needs of a request (the gateway's own fields stay behind)."""
    return {"request_id": request.request_id, "prompt": list(request.prompt_token_ids),
            "params": params_to_dict(request.params), "cache_salt": request.cache_salt,
            "prefill": None if request.prefill is None else request.prefill.to_dict(),
            "output_token_ids": list(request.output_token_ids)}


def request_from_dict(data: dict[str, Any]) -> GenerationRequest:
    salt, prefill = data.get("cache_salt"), data.get("prefill")
    return GenerationRequest(
        str(data["request_id"]), token_ids(data["prompt"]), params_from_dict(data["params"]),
        cache_salt=None if salt is None else str(salt),
        prefill=None if prefill is None else PrefillResult.from_dict(prefill),
        output_token_ids=tuple(token_ids(data.get("output_token_ids", []), "output")))
