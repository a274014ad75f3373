"""JSON forms of the engine's request types, for the control channel."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.services.protocol.sampling_params import SamplingParams


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
