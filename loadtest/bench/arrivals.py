"""When requests are sent: a fixed number in flight, or a Poisson/gamma process at a rate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Load:
    """One offered load: ``concurrency`` requests in flight, or ``rate`` requests per second.

    Inter-arrival gaps at a rate are gamma-distributed with shape ``burstiness`` and mean 1/rate
    (as in ``vllm bench serve``): 1 is Poisson, below 1 burstier, above 1 more regular. An
    infinite rate sends everything at once.
    """

    mode: Literal["concurrency", "rate"]
    value: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.mode == "concurrency" and (self.value < 1 or self.value != int(self.value)):
            raise ValueError(f"concurrency must be a whole number >= 1, got {self.value:g}")
        if self.mode == "rate" and not self.value > 0:
            raise ValueError(f"request rate must be > 0 requests/s, got {self.value:g}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness:g}")

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency {int(self.value)}"
        burst = "" if self.burstiness == 1.0 else f", burstiness {self.burstiness:g}"
        return f"{self.value:g} req/s{burst}"

    @property
    def axis_value(self) -> str:
        return "inf" if math.isinf(self.value) else f"{self.value:g}"


def parse_rate(text: str) -> float:
    """A request rate in requests/s: a positive number or ``inf``."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"invalid request rate {text!r}: use a number > 0 or 'inf'") from None
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0 requests/s, got {text}")
    return rate


def parse_concurrency(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid concurrency {text!r}: use a whole number >= 1") from None
    if value < 1:
        raise ValueError(f"concurrency must be >= 1, got {value}")
    return value


def arrival_offsets(n: int, load: Load, rng: np.random.Generator) -> list[float]:
    """Send times (seconds after the start) of n requests at ``load``'s rate; first at 0."""
    if load.mode != "rate":
        raise ValueError("arrival times exist only for a request rate")
    if math.isinf(load.value) or n == 0:
        return [0.0] * n
    gaps = rng.gamma(shape=load.burstiness, scale=1.0 / (load.value * load.burstiness),
                     size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
