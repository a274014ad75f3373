"""The planner's arithmetic: how many prefill and decode workers meet the SLOs at least cost.

Pure functions of a ``Profile`` (what ONE worker of each role does), a ``Load`` (what arrives)
and an ``SLO``. The targets are for the mean TTFT and the mean TPOT.

Decode (Little's law): a request decodes for ``L_out · ITL(b)`` seconds, so ``λ · L_out ·
ITL(b)`` streams decode at once; at ``b`` streams per worker that is ``D = ceil(λ · L_out ·
ITL(b*) / b*)`` workers, where ``b*`` is the largest batch (<= max_num_seqs) whose fitted
``ITL(b) = a + c · b`` meets the TPOT target. With D workers each runs ``b = λ · L_out · a /
(D − λ · L_out · c)`` streams (the fixed point of ``b = λ · L_out · ITL(b) / D``): the
predicted TPOT is ``ITL(b)``.

Prefill (M/D/1 per worker): one prompt takes ``S = overhead + L_in · (1 − h) / tokens_per_s``;
with P workers each is busy ``ρ = λ · S / P`` and a prompt waits ``W = ρ · S / (2 · (1 − ρ))``
on average; P is the smallest count with ``ρ < 1`` and ``S + W <= TTFT target``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_WORKERS = 10_000  # a search bound: no plan needs more of one role


class PlanError(ValueError):
    """No worker count meets the SLO (the message says which target and why)."""


@dataclass(frozen=True)
class Profile:
    """What ONE worker of each role does, measured (``services/planner/profile.py``).

    Prefill: a prompt of n new tokens takes ``prefill_overhead_s + n / prefill_tokens_per_s``
    alone on a worker (the overhead: the fixed part of TTFT, gateway included). Decode: the
    time per output token at b streams in the batch is ``itl_base_s + itl_per_seq_s · b``.
    """

    prefill_tokens_per_s: float
    itl_base_s: float
    itl_per_seq_s: float
    max_num_seqs: int = 128
    prefill_overhead_s: float = 0.0
    source: str = ""  # where it was measured (shown in the explanation)

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"profile: prefill_tokens_per_s must be > 0, got "
                             f"{self.prefill_tokens_per_s:g}")
        if not self.itl_base_s > 0 or self.itl_per_seq_s < 0:
            raise ValueError(f"profile: ITL(b) = a + c·b needs a > 0 and c >= 0, got a = "
                             f"{self.itl_base_s:g}, c = {self.itl_per_seq_s:g}")
        if self.max_num_seqs < 1 or self.prefill_overhead_s < 0:
            raise ValueError("profile: max_num_seqs must be >= 1 and prefill_overhead_s >= 0")

    def itl(self, batch: float) -> float:
        return self.itl_base_s + self.itl_per_seq_s * batch

    def prefill_time(self, new_tokens: float) -> float:
        return self.prefill_overhead_s + new_tokens / self.prefill_tokens_per_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        fields = cls.__dataclass_fields__
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"profile: unknown keys {sorted(unknown)}")
        required = {"prefill_tokens_per_s", "itl_base_s", "itl_per_seq_s"}
        if missing := required - set(data):
            raise ValueError(f"profile: missing keys {sorted(missing)}")
        for name, value in data.items():
            wanted = str if name == "source" else int if name == "max_num_seqs" else float
            if isinstance(value, bool) or not isinstance(value, wanted | int):
                raise ValueError(f"profile: {name} must be a {wanted.__name__}, got {value!r}")
        return cls(**data)


@dataclass(frozen=True)
class Load:
    """What arrives: requests/s, mean prompt and output tokens, prefix-cache hit rate."""

    rate: float
    prompt_tokens: float
    output_tokens: float
    hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.rate < 0 or self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError("load: rate and token counts must be >= 0")
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"load: hit rate must be in [0, 1], got {self.hit_rate:g}")

    def scaled(self, factor: float) -> Load:
        return Load(self.rate * factor, self.prompt_tokens, self.output_tokens, self.hit_rate)

    def describe(self) -> str:
        return (f"λ = {self.rate:.3g} req/s, L_in = {self.prompt_tokens:.0f} prompt tokens, "
                f"L_out = {self.output_tokens:.0f} output tokens, prefix hit rate h = "
                f"{self.hit_rate:.0%}")


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.tpot_s > 0:
            raise ValueError("SLO: the TTFT and TPOT targets must be > 0")


@dataclass(frozen=True)
class Plan:
    prefill: int
    decode: int
    ttft_s: float  # predicted mean TTFT with ``prefill`` workers
    tpot_s: float  # predicted mean TPOT with ``decode`` workers
    decode_batch: float  # streams per decode worker at that size
    prefill_utilisation: float
    steps: list[str] = field(default_factory=list)

    def explain(self) -> str:
        return "\n".join(self.steps)


@dataclass(frozen=True)
class PrefillSize:
    workers: int
    service_s: float
    utilisation: float
    ttft_s: float


@dataclass(frozen=True)
class DecodeSize:
    workers: int
    target_batch: int
    batch: float
    tpot_s: float


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def prefill_ttft(profile: Profile, load: Load, workers: int) -> PrefillSize:
    """The mean TTFT (M/D/1: service + mean wait) with ``workers`` prefill workers; infinite
    when they cannot keep up."""
    service = profile.prefill_time(load.prompt_tokens * (1.0 - load.hit_rate))
    rho = load.rate * service / workers
    ttft = service + rho * service / (2.0 * (1.0 - rho)) if rho < 1.0 else math.inf
    return PrefillSize(workers, service, rho, ttft)


def size_prefill(profile: Profile, load: Load, ttft_s: float) -> PrefillSize:
    one = prefill_ttft(profile, load, 1)
    if one.service_s > ttft_s:
        raise PlanError(f"TTFT target {ms(ttft_s)} is below one prompt's own prefill time "
                        f"{ms(one.service_s)} (L_in·(1−h) = "
                        f"{load.prompt_tokens * (1 - load.hit_rate):.0f} tokens): no number of "
                        f"prefill workers meets it")
    for workers in range(1, MAX_WORKERS + 1):
        size = prefill_ttft(profile, load, workers)
        if size.ttft_s <= ttft_s:
            return size
    raise PlanError(f"TTFT target {ms(ttft_s)} needs more than {MAX_WORKERS} prefill workers")


def target_batch(profile: Profile, tpot_s: float) -> int:
    """The largest batch (<= max_num_seqs) whose ITL meets the TPOT target."""
    if profile.itl(1) > tpot_s:
        raise PlanError(f"TPOT target {ms(tpot_s)} is below one stream's own ITL "
                        f"{ms(profile.itl(1))}: no batch size meets it")
    if profile.itl_per_seq_s == 0:
        return profile.max_num_seqs
    best = math.floor((tpot_s - profile.itl_base_s) / profile.itl_per_seq_s + 1e-9)
    return max(1, min(profile.max_num_seqs, best))


def decode_batch(profile: Profile, load: Load, workers: int) -> float:
    """Streams per decode worker: b = λ·L_out·a / (D − λ·L_out·c); infinite if unstable."""
    flow = load.rate * load.output_tokens
    room = workers - flow * profile.itl_per_seq_s
    return flow * profile.itl_base_s / room if room > 0 else math.inf


def size_decode(profile: Profile, load: Load, tpot_s: float) -> DecodeSize:
    best = target_batch(profile, tpot_s)
    flow = load.rate * load.output_tokens
    workers = max(1, math.ceil(flow * profile.itl(best) / best - 1e-9))
    batch = decode_batch(profile, load, workers)
    return DecodeSize(workers, best, batch, profile.itl(batch))


def plan(profile: Profile, load: Load, slo: SLO) -> Plan:
    """The fewest prefill and decode workers meeting ``slo`` at ``load``, explained."""
    pre = size_prefill(profile, load, slo.ttft_s)
    dec = size_decode(profile, load, slo.tpot_s)
    flow = load.rate * load.output_tokens
    new_tokens = load.prompt_tokens * (1 - load.hit_rate)
    steps = [
        f"load: {load.describe()}",
        f"SLO: mean TTFT <= {ms(slo.ttft_s)}, mean TPOT <= {ms(slo.tpot_s)}",
        f"profile{f' ({profile.source})' if profile.source else ''}: prefill "
        f"{profile.prefill_tokens_per_s:.0f} tokens/s + {ms(profile.prefill_overhead_s)} per "
        f"prompt; ITL(b) = {ms(profile.itl_base_s)} + {ms(profile.itl_per_seq_s)}·b, "
        f"b <= {profile.max_num_seqs}",
        f"prefill: S = {ms(profile.prefill_overhead_s)} + {new_tokens:.0f} / "
        f"{profile.prefill_tokens_per_s:.0f} = {ms(pre.service_s)}; with P = {pre.workers}: "
        f"ρ = λ·S/P = {load.rate:.3g}·{pre.service_s:.4g}/{pre.workers} = "
        f"{pre.utilisation:.2f}, W = ρ·S/(2(1−ρ)) = {ms(pre.ttft_s - pre.service_s)}, TTFT = "
        f"S + W = {ms(pre.ttft_s)} <= {ms(slo.ttft_s)}"
        + (f" (P = {pre.workers - 1}: TTFT = "
           f"{ms(prefill_ttft(profile, load, pre.workers - 1).ttft_s)})"
           if pre.workers > 1 else ""),
        f"decode: b* = {dec.target_batch} (largest b with ITL(b) <= {ms(slo.tpot_s)}: "
        f"ITL({dec.target_batch}) = {ms(profile.itl(dec.target_batch))}); streams = "
        f"λ·L_out·ITL(b*) = {flow:.4g}·{profile.itl(dec.target_batch):.4g} = "
        f"{flow * profile.itl(dec.target_batch):.3g}; D = ceil(streams / b*) = {dec.workers}; "
        f"at D = {dec.workers} each runs b = λ·L_out·a/(D − λ·L_out·c) = {dec.batch:.2f} "
        f"streams, TPOT = ITL(b) = {ms(dec.tpot_s)}",
        f"plan: {pre.workers} prefill + {dec.workers} decode workers",
    ]
    return Plan(pre.workers, dec.workers, pre.ttft_s, dec.tpot_s, dec.batch, pre.utilisation,
                steps)
