"""The doctor's numbers, answers and lever ranking on the three states it must tell apart, from
hand-written /metrics texts (tests/doctor/metrics_text.py) with numbers checked by hand."""

from __future__ import annotations

import pytest

from tandem.services.doctor.diagnosis import NoTraffic, diagnose
from tandem.services.doctor.evidence import Evidence
from tandem.services.doctor.levers import ranked, recommended
from tandem.services.doctor.questions import answer_all
from tandem.services.doctor.report import Report

from .metrics_text import (
    DISAGG,
    Metrics,
    decode_state,
    engine,
    full_decode_state,
    kv_state,
    prefix_state,
)


def effects(evidence: Evidence) -> dict[str, float]:
    return {lever.key: round(lever.effect, 4) for lever in ranked(diagnose(evidence))}


def test_prefix_heavy_traffic_with_round_robin_ranks_prefix_routing_first() -> None:
    d = diagnose(prefix_state())
    assert d.request_rate == pytest.approx(2.0)
    assert d.queue_s == pytest.approx(0.1)  # 0.2 waiting / 2 per s
    assert d.prefill_s == pytest.approx(0.4)
    assert d.transfer_s == pytest.approx(0.02)
    assert d.decode_s == pytest.approx(0.08)  # 0.6 - 0.5 - 0.02
    assert (d.hit_rate, d.reachable, d.chosen) == (0.0, 0.5, 0.0)
    assert d.prompt_tokens == 194
    # prefix: 0.4 s x 0.5 lost / 1.0 computed = 0.2 s of 0.6; another prefill worker: 0.1 / 3;
    # speculation: 0.08 x (1 - 1/1.47) x (1 - 1 running / 16); NIXL: 0.02 - 0.005.
    assert effects(prefix_state()) == {
        "prefix_routing": round(0.2 / 0.6, 4), "prefill_workers": round(0.1 / 3 / 0.6, 4),
        "speculation": round(0.08 * (1 - 1 / 1.47) * 15 / 16 / 0.6, 4),
        "kv_transport": round(0.015 / 0.6, 4)}
    top = ranked(d)[0]
    assert (top.key, top.change) == ("prefix_routing", "--routing-policy prefix")
    assert "50% of prompt blocks were cached on some prefill worker, 0% on the chosen" in (
        top.evidence)


def test_kv_pressure_with_preemptions_ranks_kv_memory_first() -> None:
    d = diagnose(kv_state())
    assert d.memory_bound and d.batch_fill == 1.0
    assert d.queue_s == pytest.approx(0.5)  # 0.5 waiting / 1 per s
    assert d.prefill_s_per_token == pytest.approx(0.005)  # 0.5 s / 100 computed tokens
    assert d.preemptions_per_request == 0.5
    # 0.5 preemptions x (100 + 64/2) tokens x 5 ms = 0.33 s recomputed, + 0.5 s waiting, of 5 s;
    # speculation has no spare room in a batch KV stopped.
    assert effects(kv_state()) == {"kv_memory": round(0.83 / 5, 4), "speculation": 0.0}
    top = ranked(d)[0]
    assert (top.key, top.change) == ("kv_memory", "num_kv_blocks: 48 (config)")
    assert [lever.key for lever in recommended(ranked(d))] == ["kv_memory"]


def test_decode_bound_with_speculation_off_ranks_speculation_first() -> None:
    d = diagnose(decode_state())
    assert d.decode_s == pytest.approx(3.79)  # 4 - 0.2 - 0.01
    assert not d.memory_bound and d.batch_fill == pytest.approx(2 / 32)
    # 3.79 s x (1 - 1/1.47) x (1 - 2/16) of 4 s; nothing was cached anywhere; NIXL saves 5 ms.
    assert effects(decode_state()) == {"speculation": round(3.79 * (1 - 1 / 1.47) * 14 / 16 / 4,
                                                            4),
                                       "kv_transport": round(0.005 / 4, 4),
                                       "prefix_routing": 0.0}
    levers = recommended(ranked(d))
    assert [(lever.key, lever.change) for lever in levers] == [("speculation", "--spec ngram")]


def test_full_decode_batches_with_sequences_waiting_rank_another_decode_worker_first() -> None:
    d = diagnose(full_decode_state())
    assert d.decode_wait_s == pytest.approx(2.0)  # 2 waiting / 1 per s
    assert not d.memory_bound and d.batch_fill == pytest.approx(30 / 32)
    # another decode worker: 2 s / 2 of 6 s; speculation: no room for drafts at 30 running
    # (the adaptive policy stops at 16); NIXL: 10 ms - 5 ms.
    assert effects(full_decode_state()) == {
        "decode_workers": round(1.0 / 6, 4), "speculation": 0.0,
        "kv_transport": round(0.005 / 6, 4)}
    assert ranked(d)[0].change == "--decode 2"


def test_the_six_answers_name_what_dominates() -> None:
    verdicts = {a.key: a.verdict for a in answer_all(diagnose(decode_state()))}
    assert list(verdicts) == ["latency", "prefix", "batch", "context", "memory", "speculation"]
    assert verdicts["latency"] == "decode dominates: 95% of a mean request's 4000 ms"
    assert verdicts["speculation"] == "speculative decoding is off"
    assert verdicts["batch"].startswith("small batches (2.0 of 32)")
    kv = {a.key: a.verdict for a in answer_all(diagnose(kv_state()))}
    assert kv["memory"].startswith("KV pressure: 5 preemptions (0.50 per request)")
    assert kv["prefix"].startswith("one engine")
    prefix = {a.key: a.verdict for a in answer_all(diagnose(prefix_state()))}
    assert prefix["prefix"].startswith("50% of prompt blocks were cached on another")


def test_a_window_without_ended_requests_is_no_traffic() -> None:
    m = engine(Metrics(DISAGG, {"p0": "prefill"}), "p0")
    evidence = Evidence(m.scrape(), m.scrape(), 5.0, (m.scrape(),))
    with pytest.raises(NoTraffic, match="no request ended in the 5.0 s window"):
        diagnose(evidence)


def test_the_report_lists_levers_then_the_questions() -> None:
    report = Report.of("http://gw", diagnose(prefix_state()))
    text = report.markdown()
    assert text.startswith("# tandem doctor: http://gw\n\nMeasured over the last 10 s.")
    assert "| 1 | route prompts to the worker caching their prefix | `--routing-policy " \
           "prefix` | 33% |" in text
    assert text.index("## Levers") < text.index("## The six questions")
    assert "![" not in text  # plots only in the file --out writes
    data = report.to_json()
    assert data["recommended"][0] == "prefix_routing"
    assert [a["key"] for a in data["answers"]][0] == "latency"
