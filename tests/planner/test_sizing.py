"""The planner's arithmetic against cases computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest

from tandem.services.planner.sizing import SLO, Load, PlanError, Profile, plan, prefill_ttft

# One worker: a prompt of n new tokens takes 0.05 + n / 1000 s; ITL(b) = 20 ms + 1 ms · b.
PROFILE = Profile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.05, itl_base_s=0.020,
                  itl_per_seq_s=0.001, max_num_seqs=64)
# 4 req/s of 500 prompt tokens (20 % from the prefix cache) and 100 output tokens.
LOAD = Load(rate=4.0, prompt_tokens=500.0, output_tokens=100.0, hit_rate=0.2)


def test_prefill_hand_computed() -> None:
    # S = 0.05 + 500 · (1 − 0.2) / 1000 = 0.45 s.
    # P = 4: ρ = 4 · 0.45 / 4 = 0.45, W = 0.45 · 0.45 / (2 · 0.55) = 0.184091 s, TTFT = 0.634091
    # P = 5: ρ = 0.36, W = 0.36 · 0.45 / (2 · 0.64) = 0.1265625 s, TTFT = 0.5765625 s <= 0.6
    result = plan(PROFILE, LOAD, SLO(ttft_s=0.6, tpot_s=0.05))
    assert result.prefill == 5
    assert result.ttft_s == pytest.approx(0.5765625)
    assert result.prefill_utilisation == pytest.approx(0.36)
    assert prefill_ttft(PROFILE, LOAD, 4).ttft_s == pytest.approx(0.45 + 0.2025 / 1.1)
    # P = 1 and 2: ρ = 1.8 (overloaded: infinite), ρ = 0.9: W = 0.405 / 0.2 = 2.025 s.
    assert prefill_ttft(PROFILE, LOAD, 1).ttft_s == float("inf")
    assert prefill_ttft(PROFILE, LOAD, 2).ttft_s == pytest.approx(2.475)


def test_decode_hand_computed() -> None:
    # b* = floor((50 − 20) / 1) = 30 streams (ITL(30) = 50 ms, the TPOT target).
    # λ · L_out = 4 · 100 = 400 tokens/s; streams = 400 · 0.05 = 20; D = ceil(20 / 30) = 1.
    # At D = 1: b = 400 · 0.02 / (1 − 400 · 0.001) = 8 / 0.6 = 13.33; TPOT = 20 + 13.33 ms.
    result = plan(PROFILE, LOAD, SLO(ttft_s=0.6, tpot_s=0.05))
    assert result.decode == 1
    assert result.decode_batch == pytest.approx(40 / 3)
    assert result.tpot_s == pytest.approx(0.020 + 0.001 * 40 / 3)


def test_decode_at_a_higher_rate() -> None:
    # λ = 20: λ · L_out = 2000 tokens/s; streams = 2000 · 0.05 = 100; D = ceil(100 / 30) = 4.
    # At D = 4: b = 2000 · 0.02 / (4 − 2000 · 0.001) = 40 / 2 = 20; TPOT = 20 + 20 = 40 ms.
    result = plan(PROFILE, Load(20.0, 500.0, 100.0, 0.2), SLO(ttft_s=0.6, tpot_s=0.05))
    assert result.decode == 4
    assert result.decode_batch == pytest.approx(20.0)
    assert result.tpot_s == pytest.approx(0.040)


def test_max_num_seqs_caps_the_batch() -> None:
    # A flat ITL (c = 0) would allow any batch: b* = max_num_seqs = 8.
    # streams = 2000 · 0.02 = 40; D = ceil(40 / 8) = 5.
    flat = Profile(prefill_tokens_per_s=1000.0, itl_base_s=0.020, itl_per_seq_s=0.0,
                   max_num_seqs=8)
    assert plan(flat, Load(20.0, 100.0, 100.0), SLO(1.0, 0.05)).decode == 5


def test_the_explanation_shows_the_numbers() -> None:
    text = plan(PROFILE, LOAD, SLO(ttft_s=0.6, tpot_s=0.05)).explain()
    assert "S = 50.0 ms + 400 / 1000 = 450.0 ms" in text
    assert "ρ = λ·S/P = 4·0.45/5 = 0.36" in text
    assert "TTFT = S + W = 576.6 ms" in text
    assert "(P = 4: TTFT = 634.1 ms)" in text
    assert "b* = 30" in text and "D = ceil(streams / b*) = 1" in text
    assert "plan: 5 prefill + 1 decode workers" in text


def test_no_batch_meets_the_tpot_target() -> None:
    # ITL(1) = 21 ms > 15 ms: even one stream per worker is too slow.
    with pytest.raises(PlanError, match=r"TPOT target 15.0 ms is below one stream's own ITL "
                                        r"21.0 ms"):
        plan(PROFILE, LOAD, SLO(ttft_s=0.6, tpot_s=0.015))


def test_ttft_unreachable_with_any_number_of_workers() -> None:
    # S = 0.45 s > 0.4 s: a prompt alone on an idle worker already misses the target.
    with pytest.raises(PlanError, match="below one prompt's own prefill time 450.0 ms .* no "
                                        "number of prefill workers meets it"):
        plan(PROFILE, LOAD, SLO(ttft_s=0.4, tpot_s=0.05))


def test_no_load_needs_one_of_each() -> None:
    result = plan(PROFILE, Load(0.0, 500.0, 100.0), SLO(ttft_s=0.6, tpot_s=0.05))
    assert (result.prefill, result.decode) == (1, 1)
    assert result.ttft_s == pytest.approx(0.55) and result.tpot_s == pytest.approx(0.020)


def test_more_load_or_tighter_targets_never_need_fewer_workers() -> None:
    slo = SLO(ttft_s=0.6, tpot_s=0.05)
    counts = [plan(PROFILE, LOAD.scaled(f), slo) for f in (0.5, 1, 2, 4, 8, 16)]
    assert [c.prefill for c in counts] == sorted(c.prefill for c in counts)
    assert [c.decode for c in counts] == sorted(c.decode for c in counts)
    assert counts[-1].prefill > counts[0].prefill and counts[-1].decode > counts[0].decode
    by_ttft = [plan(PROFILE, LOAD, SLO(t, 0.05)).prefill for t in (2.0, 1.0, 0.7, 0.6, 0.5)]
    assert by_ttft == sorted(by_ttft)
    by_tpot = [plan(PROFILE, LOAD.scaled(8), SLO(0.6, t)).decode for t in (0.1, 0.05, 0.03)]
    assert by_tpot == sorted(by_tpot)
    for c in counts:  # every plan meets what it was asked
        assert c.ttft_s <= slo.ttft_s and c.tpot_s <= slo.tpot_s


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Profile(prefill_tokens_per_s=0.0, itl_base_s=0.02, itl_per_seq_s=0.0)
    with pytest.raises(ValueError, match="hit rate"):
        Load(1.0, 10.0, 10.0, hit_rate=1.5)
    with pytest.raises(ValueError, match="unknown keys"):
        Profile.from_json({**PROFILE.to_json(), "extra": 1})
    assert Profile.from_json(PROFILE.to_json()) == PROFILE
