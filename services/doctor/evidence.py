"""What the doctor knows: reads of the gateway's /metrics turned into typed numbers.

A ``Scrape`` is one read; ``Evidence`` is a window between two reads (counters and histograms as
differences) plus the gauges of every read taken in between (running, waiting, KV usage, per
role), so that queue lengths and batch sizes are time averages, not one instant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.services.serving.up_stats import metric_samples

# Engine series carry only ``worker``; its role comes from tandem_worker_info. A colocated
# gateway's one engine is ``colocated``.
COLOCATED = "colocated"
DECODING_ROLES = ("decode", COLOCATED)  # roles whose engines generate past the first token
PREFILLING_ROLES = ("prefill", COLOCATED)  # roles whose engines compute prompts


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets (upper bound, count), their count and sum."""

    buckets: tuple[tuple[float, float], ...] = ()
    count: float = 0.0
    total: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (as Prometheus'
        histogram_quantile, without interpolation: an upper limit)."""
        if self.count <= 0:
            return None
        rank = q * self.count
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                return bound
        return math.inf

    def minus(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(tuple((b, c - before.get(b, 0.0)) for b, c in self.buckets),
                         self.count - earlier.count, self.total - earlier.total)


@dataclass(frozen=True)
class Scrape:
    """One read of /metrics: every sample, the workers' roles and the cluster's settings."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]
    roles: dict[str, str]  # worker -> prefill | decode | colocated
    config: dict[str, str]  # tandem_config_info's labels; empty for a gateway without it

    @classmethod
    def parse(cls, metrics_text: str) -> Scrape:
        """Raises ``ValueError`` for text that is not Prometheus'."""
        samples = []
        roles: dict[str, str] = {}
        config: dict[str, str] = {}
        for sample in metric_samples(metrics_text):
            labels = tuple(sorted(sample.labels.items()))
            samples.append((sample.name, labels, float(sample.value)))
            if sample.name == "tandem_worker_info":
                roles[sample.labels.get("worker", "")] = sample.labels.get("role", "")
            elif sample.name == "tandem_config_info":
                config = {k: v for k, v in sample.labels.items() if k != "model_name"}
        return cls(tuple(samples), roles, config)

    def role(self, worker: str) -> str:
        return self.roles.get(worker) or (COLOCATED if worker == COLOCATED else "")

    def total(self, name: str, roles: Sequence[str] | None = None, **match: str) -> float:
        """The sum of ``name``'s samples whose labels include ``match`` (and, with ``roles``,
        whose worker has one of those roles)."""
        value = 0.0
        for sample_name, labels, sample_value in self.samples:
            if sample_name != name:
                continue
            label = dict(labels)
            if any(label.get(k) != v for k, v in match.items()):
                continue
            if roles is not None and self.role(label.get("worker", "")) not in roles:
                continue
            value += sample_value
        return value

    def per_worker(self, name: str, roles: Sequence[str]) -> dict[str, float]:
        values: dict[str, float] = {}
        for sample_name, labels, value in self.samples:
            worker = dict(labels).get("worker", "")
            if sample_name == name and self.role(worker) in roles:
                values[worker] = values.get(worker, 0.0) + value
        return values

    def histogram(self, name: str, roles: Sequence[str] | None = None) -> Histogram:
        """``name``'s buckets, count and sum, summed over its label sets."""
        buckets: dict[float, float] = {}
        for sample_name, labels, value in self.samples:
            if sample_name != f"{name}_bucket":
                continue
            label = dict(labels)
            if roles is not None and self.role(label.get("worker", "")) not in roles:
                continue
            bound = float(label["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
        return Histogram(tuple(sorted(buckets.items())),
                         self.total(f"{name}_count", roles), self.total(f"{name}_sum", roles))


EMPTY = Scrape((), {}, {})  # every counter at zero: what a gateway had at its start


@dataclass(frozen=True)
class GaugeStats:
    """One gauge over the reads of a window, per worker of some roles: the mean (over reads)
    of the workers' mean, and the largest a single worker showed."""

    mean: float = 0.0
    peak: float = 0.0
    sum_mean: float = 0.0  # the mean over reads of the workers' sum

    @classmethod
    def over(cls, scrapes: Sequence[Scrape], name: str, roles: Sequence[str]) -> GaugeStats:
        means, sums, peak = [], [], 0.0
        for scrape in scrapes:
            values = list(scrape.per_worker(name, roles).values())
            if values:
                means.append(sum(values) / len(values))
                sums.append(sum(values))
                peak = max(peak, *values)
        if not means:
            return cls()
        return cls(sum(means) / len(means), peak, sum(sums) / len(sums))


@dataclass(frozen=True)
class Evidence:
    """A window of the cluster's life: ``first`` and ``last`` read ``window_s`` apart (``first``
    is ``EMPTY`` for "since the gateway started"), ``reads`` every read in it (gauges)."""

    first: Scrape
    last: Scrape
    window_s: float
    reads: tuple[Scrape, ...] = field(default=())

    @property
    def config(self) -> dict[str, str]:
        return self.last.config

    def delta(self, name: str, roles: Sequence[str] | None = None, **match: str) -> float:
        return max(0.0, self.last.total(name, roles, **match)
                   - self.first.total(name, roles, **match))

    def histogram(self, name: str, roles: Sequence[str] | None = None) -> Histogram:
        return self.last.histogram(name, roles).minus(self.first.histogram(name, roles))

    def gauge(self, name: str, roles: Sequence[str]) -> GaugeStats:
        return GaugeStats.over(self.reads or (self.last,), name, roles)

    def workers(self, roles: Sequence[str]) -> int:
        return sum(1 for role in self.last.roles.values() if role in roles)
