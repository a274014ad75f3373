"""From a plan to the worker counts to set: hysteresis, bounds and the cool-down.

* Scale up at once: a count above the current one is taken as it is.
* Scale down only out of a dead band: a lower count is taken only when the plan at the load
  times ``1 + margin`` is also below the current count, and then that (higher) count; so a load
  wobbling around a step does not flap.
* Bounds (the chart's ``planner.bounds``): the count is clamped into [min, max], and the
  explanation says so.
* Cool-down: no change within ``cooldown_s`` of the last one the planner applied.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from tandem.services.planner.sizing import SLO, Load, Plan, PlanError, Profile, plan

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Bounds:
    low: int = 1
    high: int | None = None  # None: no upper bound

    def __post_init__(self) -> None:
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise ValueError(f"bounds {self.describe()}: need 1 <= min <= max")

    def describe(self) -> str:
        return f"{self.low}-{'' if self.high is None else self.high}"

    @classmethod
    def parse(cls, text: str) -> Bounds:
        """``"1-4"`` (min-max) or ``"2-"`` (no maximum)."""
        low, sep, high = text.strip().partition("-")
        if not sep or not low.isdigit() or not (high.isdigit() or high == ""):
            raise ValueError(f"bounds {text!r}: use MIN-MAX, e.g. 1-4 (or 2- for no maximum)")
        return cls(int(low), int(high) if high else None)

    def clamp(self, count: int) -> int:
        count = max(self.low, count)
        return count if self.high is None else min(self.high, count)


@dataclass(frozen=True)
class Decision:
    current: dict[str, int]
    target: dict[str, int]  # what to set (== current: nothing to do)
    planned: Plan
    notes: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return self.target != self.current

    def explain(self) -> str:
        return "\n".join([self.planned.explain(), *self.notes])


def decide(profile: Profile, load: Load, slo: SLO, current: dict[str, int],
           bounds: dict[str, Bounds], margin: float, cooldown_s: float,
           last_change: dt.datetime | None, now: dt.datetime) -> Decision:
    """The counts to set now; ``PlanError`` when no count meets the SLOs."""
    planned = plan(profile, load, slo)
    wanted = {"prefill": planned.prefill, "decode": planned.decode}
    notes: list[str] = []
    if any(wanted[role] < current[role] for role in ROLES):
        try:
            padded = plan(profile, load.scaled(1.0 + margin), slo)
            at_margin = {"prefill": padded.prefill, "decode": padded.decode}
        except PlanError:
            at_margin = dict(current)
        for role in ROLES:
            if wanted[role] < current[role]:
                kept = min(current[role], at_margin[role])
                notes.append(
                    f"{role}: scale-down to {wanted[role]} checked at load × {1 + margin:g}: "
                    f"{at_margin[role]} needed there, so "
                    + (f"{kept} (down from {current[role]})" if kept < current[role]
                       else f"stay at {current[role]} (dead band)"))
                wanted[role] = kept
    target = {}
    for role in ROLES:
        limit = bounds.get(role, Bounds())
        target[role] = limit.clamp(wanted[role])
        if target[role] != wanted[role]:
            notes.append(f"{role}: {wanted[role]} clamped to {target[role]} by the bounds "
                         f"{limit.describe()}")
    if target != current and last_change is not None:
        since = (now - last_change).total_seconds()
        if since < cooldown_s:
            notes.append(f"cool-down: the last change was {since:.0f} s ago (< {cooldown_s:g} s); "
                         f"keeping {current['prefill']} prefill + {current['decode']} decode "
                         f"instead of {target['prefill']} + {target['decode']}")
            target = dict(current)
    notes.append(f"decision: {target['prefill']} prefill + {target['decode']} decode "
                 + ("(unchanged)" if target == current else
                    f"(now {current['prefill']} + {current['decode']})"))
    return Decision(current, target, planned, notes)
