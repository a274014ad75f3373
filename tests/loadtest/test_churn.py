"""The churn benchmark's reading of /metrics (its run itself needs minutes: docs/loadtest.md)."""

from __future__ import annotations

import math

from tandem.loadtest.churn import _role_delta, histogram_quantile


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.5, 2.0), (1.0, 6.0), (2.5, 8.0), (math.inf, 8.0)]
    assert histogram_quantile(0.25, buckets) == 0.5  # rank 2: the top of the first bucket
    assert histogram_quantile(0.5, buckets) == 0.75  # rank 4: halfway through (0.5, 1]
    assert histogram_quantile(0.99, [(1.0, 0.0), (math.inf, 3.0)]) == 1.0  # above every bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_role_delta_counts_decode_workers_and_new_ones_from_zero() -> None:
    info = [({"worker": "p", "role": "prefill"}, 1.0), ({"worker": "d1", "role": "decode"}, 1.0),
            ({"worker": "d2", "role": "decode"}, 1.0)]
    name = "tandem_prefix_cache_hits_total"
    before = {name: [({"worker": "p"}, 5.0), ({"worker": "d1"}, 10.0)]}
    after = {name: [({"worker": "p"}, 50.0), ({"worker": "d1"}, 15.0), ({"worker": "d2"}, 7.0)],
             "tandem_worker_info": info}
    assert _role_delta(before, after, "hits") == 12.0  # d1: +5, d2 (replacement): 7
