"""The overload benchmark's arithmetic on recorded numbers: medians over rounds, totals of what
must not happen, the client-side peak of admitted requests, and the settings it starts with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.loadtest.overload import (
    RunFigures,
    _settings,
    build_parser,
    factor_rows,
    peak_admitted,
    render_table,
)
from tandem.services.protocol.bench_records import RequestRecord


def figures(factor: float, round_: int, *, goodput: float, ttft_p99: float | None,
            sent: int = 10, good: int = 5, rejected: int = 0, failed: int = 0,
            mid_stream: int = 0, rss: float = 180.0, peak: int = 4) -> RunFigures:
    return RunFigures(
        factor=factor, round=round_, rate=factor * 2.0, sent=sent, completed=sent - rejected,
        rejected=rejected, failed=failed, mid_stream_errors=mid_stream, duration_s=10.0,
        request_throughput=1.0, good=good, goodput=goodput, ttft_p50_ms=100.0,
        ttft_p99_ms=ttft_p99, tpot_p50_ms=50.0, peak_admitted=peak,
        server_rejected=float(rejected), gateway_rss_before_mib=170.0, gateway_rss_peak_mib=rss)


def test_rows_take_medians_over_rounds_and_totals_of_failures() -> None:
    runs = [figures(0.8, 0, goodput=1.5, ttft_p99=900.0, rss=180.0),
            figures(2.0, 0, goodput=0.5, ttft_p99=None, sent=20, good=2, rejected=10,
                    failed=1, mid_stream=1, rss=200.0, peak=64),
            figures(0.8, 1, goodput=1.0, ttft_p99=700.0, good=10, rss=190.0),
            figures(2.0, 1, goodput=0.25, ttft_p99=8000.0, sent=20, good=0, rejected=5,
                    failed=2, rss=260.0, peak=60),
            figures(0.8, 2, goodput=1.25, ttft_p99=800.0, good=8, rss=185.0)]
    low, high = factor_rows(runs, r_sat=2.5)
    assert (low.factor, low.rounds, high.rounds) == (0.8, 3, 2)
    assert (low.goodput, low.goodput_over_r_sat) == (1.25, 0.5)
    assert low.good_share == 0.8  # median of 5/10, 10/10, 8/10
    assert (low.ttft_p99_ms, high.ttft_p99_ms) == (800.0, 8000.0)  # a round without any: left out
    assert high.rejected_share == 0.375  # median of 10/20 and 5/20
    assert (high.mid_stream_errors, high.other_failures) == (1, 2)
    assert (high.peak_admitted, high.gateway_rss_peak_mib, high.gateway_rss_max_mib) == \
        (64, 230.0, 260.0)
    table = render_table([low, high])
    assert "| 0.8 x R_sat | 1.60 | 3 | 1.25 | 0.50 | 80% | 1.00 | 100 | 800 | 0.0% | 0 | 0 | 4 " \
           "| 185 (190) |" in table
    assert "| 2 x R_sat | 4.00 | 2 | 0.38 | 0.15 | 5% |" in table


def record(start: float, end: float | None, *, admitted: bool = True) -> RequestRecord:
    return RequestRecord(0, "random", "", 10, start, first_token_s=end, end_s=end,
                         admitted=admitted, rejected=not admitted)


def test_peak_admitted_counts_overlapping_admitted_requests_only() -> None:
    records = [record(0.0, 2.0), record(1.0, 3.0), record(2.0, 4.0),  # 2.0: one ends, one starts
               record(1.5, 1.5, admitted=False), record(2.5, None)]  # rejected; never ended
    assert peak_admitted(records) == 2
    assert peak_admitted([]) == 0


def test_r_sat_concurrency_is_a_full_decode_batch_under_the_bound(tmp_path: Path) -> None:
    args = build_parser().parse_args([])
    assert _settings(args) == {} and args.sat_concurrency == 32  # 1 decode x 32 seqs < 64
    config = tmp_path / "tight.yaml"
    config.write_text("max_in_flight: 8\ndecode_replicas: 2\n")
    args = build_parser().parse_args(["--config", str(config), "--factors", "0.5,3"])
    assert _settings(args) == {"max_in_flight": 8, "decode_replicas": 2}
    assert (args.sat_concurrency, args.factors) == (8, [0.5, 3.0])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--factors", "0,2"])
    with pytest.raises(ValueError, match="--duration must be > 0"):
        _settings(build_parser().parse_args(["--duration", "0"]))
