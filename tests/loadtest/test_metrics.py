"""Metric definitions on synthetic timelines with known answers (times are exact binary
fractions so that SLO edges compare exactly)."""

from __future__ import annotations

import pytest

from tandem.loadtest.bench.metrics import SLO, distribution, summarize
from tandem.services.protocol.bench_records import RequestRecord


def record(start: float, chunks: list[float], end: float, out: int, *, prompt: int = 10,
           server_prompt: int | None = None, error: str | None = None, kind: str = "random",
           index: int = 0) -> RequestRecord:
    return RequestRecord(index, kind, "", prompt, start,
                         first_token_s=chunks[0] if chunks else None, end_s=end,
                         chunk_times_s=chunks, output_tokens=out,
                         output_tokens_source="usage", server_prompt_tokens=server_prompt,
                         error=error)


def test_ttft_e2e_tpot_itl_of_one_request() -> None:
    r = record(1.0, [1.25, 1.5, 2.0], 2.0, out=5)
    assert r.ttft == 0.25
    assert r.e2e == 1.0
    assert r.tpot == 0.75 / 4  # (E2E - TTFT) / (output tokens - 1): 5 tokens in 3 chunks
    assert r.itls == [0.25, 0.5]


def test_tpot_is_undefined_for_one_output_token_and_left_out() -> None:
    one = record(0.0, [0.5], 0.5, out=1)
    two = record(0.0, [0.25, 0.75], 0.75, out=2)
    assert one.tpot is None
    s = summarize([one, two], duration_s=1.0, slo=SLO())
    assert s.tpot is not None and s.tpot.count == 1
    assert s.tpot.mean == 500.0  # only the two-token request: (0.75 - 0.25) / 1 s
    assert s.ttft is not None and s.ttft.count == 2


def test_single_token_request_meets_any_tpot_slo() -> None:
    one = record(0.0, [0.125], 0.125, out=1)
    assert SLO(ttft_ms=125, tpot_ms=0.001).met_by(one)
    assert not SLO(ttft_ms=124, tpot_ms=0.001).met_by(one)


def test_percentiles_interpolate_linearly() -> None:
    dist = distribution([k / 1000 for k in range(1, 101)])  # 1..100 ms
    assert dist is not None
    assert dist.count == 100
    assert dist.mean == pytest.approx(50.5)
    assert dist.p50 == pytest.approx(50.5)
    assert dist.p90 == pytest.approx(90.1)
    assert dist.p99 == pytest.approx(99.01)
    assert (dist.min, dist.max) == (pytest.approx(1.0), pytest.approx(100.0))
    assert distribution([]) is None


def test_goodput_counts_requests_at_the_slo_edge_as_good() -> None:
    slo = SLO(ttft_ms=125, tpot_ms=62.5)
    # TTFT exactly 125 ms, TPOT exactly 62.5 ms: good.
    edge = record(0.0, [0.125, 0.25, 0.375], 0.375, out=5, index=0)
    # TTFT one step over the edge: not good.
    late = record(0.0, [0.125 + 2**-20, 0.25], 0.25, out=2, index=1)
    # TPOT over the edge (0.25 s for 1 token after the first): not good.
    slow = record(0.0, [0.0625, 0.3125], 0.3125, out=2, index=2)
    assert edge.tpot == 0.0625
    assert [slo.met_by(r) for r in (edge, late, slow)] == [True, False, False]
    s = summarize([edge, late, slow], duration_s=2.0, slo=slo)
    assert s.good_requests == 1
    assert s.goodput == 0.5
    assert s.request_throughput == 1.5


def test_no_slo_means_every_completed_request_is_good() -> None:
    s = summarize([record(0.0, [1.0], 2.0, out=3), record(0.0, [], 1.0, out=0, error="HTTP 500")],
                  duration_s=4.0, slo=SLO())
    assert s.good_requests == 1
    assert s.goodput == s.request_throughput == 0.25


def test_throughput_and_tokens_count_completed_requests_only() -> None:
    ok1 = record(0.0, [0.5, 1.0], 1.0, out=8, prompt=100, server_prompt=101)
    ok2 = record(0.5, [1.0], 2.0, out=4, prompt=50)
    bad = record(0.0, [0.25], 3.0, out=16, prompt=70, error="HTTP 500: boom")
    s = summarize([ok1, ok2, bad], duration_s=4.0, slo=SLO())
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.input_tokens == 101 + 50  # the server's count where it gave one
    assert s.output_tokens == 12
    assert s.request_throughput == 0.5
    assert s.output_throughput == 3.0
    assert s.total_token_throughput == (151 + 12) / 4.0
    assert s.prompt_token_mismatches == 1
    assert s.errors == {"HTTP 500: boom": 1}
    assert s.e2e is not None and s.e2e.mean == 1250.0  # (1.0 + 1.5) / 2 s
    assert s.itl is not None and s.itl.count == 1 and s.itl.mean == 500.0


def test_rejections_are_neither_completed_nor_failed() -> None:
    done = record(0.0, [0.5], 1.0, out=2)
    refused = record(0.0, [], 0.0, out=0, error="HTTP 429: overloaded")
    broken = record(0.0, [0.5], 0.75, out=1, error="server error in stream: boom")
    unavailable = record(0.0, [], 0.125, out=0, error="HTTP 503: no worker")
    done.admitted = broken.admitted = True
    refused.rejected = True
    assert [r.mid_stream_error for r in (done, refused, broken, unavailable)] == \
        [False, False, True, False]
    s = summarize([done, refused, broken, unavailable], 1.0, SLO())
    assert (s.requests, s.completed, s.failed, s.rejected, s.mid_stream_errors) == \
        (4, 1, 2, 1, 1)
    assert s.errors == {"server error in stream: boom": 1, "HTTP 503: no worker": 1}


def test_prefix_cache_hit_rate_from_cached_tokens() -> None:
    a = record(0.0, [1.0], 1.0, out=1, prompt=100)
    a.cached_tokens = 75
    b = record(0.0, [1.0], 1.0, out=1, prompt=100)
    b.cached_tokens = 25
    s = summarize([a, b], 1.0, SLO())
    assert s.cached_tokens == 100
    assert s.prefix_cache_hit_rate == 0.5
    assert summarize([record(0.0, [1.0], 1.0, out=1)], 1.0, SLO()).prefix_cache_hit_rate is None


def test_nothing_completed() -> None:
    s = summarize([], 0.0, SLO(), requests=5)
    assert (s.requests, s.completed, s.goodput, s.request_throughput) == (5, 0, 0.0, 0.0)
    assert s.ttft is None and s.itl is None


def test_slo_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--slo-ttft-ms must be > 0"):
        SLO(ttft_ms=0)
    with pytest.raises(ValueError, match="--slo-tpot-ms must be > 0"):
        SLO(tpot_ms=-1)
