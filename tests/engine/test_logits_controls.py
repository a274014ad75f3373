"""Logits controls (penalties, logit_bias, min_tokens) and min-p: hand-computed cases, then
through the engine (greedy and sampled, with speculation and resumed)."""

from __future__ import annotations

import pytest
import torch

from tandem.services.engine.logits_controls import Draw, controlled
from tandem.services.engine.sampler import probabilities
from tandem.services.protocol.request import SamplingParams
from tests.engine.helpers import chat, run

EOS = 5
INF = float("inf")


def one_row(params: SamplingParams, logits: list[float], prompt: list[int] = (),  # type: ignore[assignment]
            output: list[int] = ()) -> list[float]:  # type: ignore[assignment]
    row = torch.tensor([logits])
    return controlled(row, [Draw(params, prompt, output)], [EOS])[0].tolist()


LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def test_no_control_returns_the_logits_themselves() -> None:
    logits = torch.tensor([LOGITS])
    assert controlled(logits, [Draw(SamplingParams(), [0], [1])], [EOS]) is logits


def test_logit_bias_adds_to_the_named_tokens() -> None:
    got = one_row(SamplingParams(logit_bias=((3, -5.0), (1, 4.0))), LOGITS)
    assert got == [2.0, 3.0, 0.5, -2.0, -2.0, 1.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    # Tokens 0 (2.0) and 4 (-2.0) in the prompt, 1 (-1.0) twice in the output: each once.
    got = one_row(SamplingParams(repetition_penalty=2.0), LOGITS, prompt=[0, 4], output=[1, 1])
    assert got == [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = one_row(params, LOGITS, prompt=[2, 2, 2], output=[3, 3, 3, 0])
    # token 3: 3.0 - 3 x 0.5 - 0.25; token 0: 2.0 - 0.5 - 0.25; the prompt's token 2 untouched
    assert got == [1.25, -1.0, 0.5, 1.25, -2.0, 1.0]
    # Negative values reward repetition.
    got = one_row(SamplingParams(frequency_penalty=-1.0), LOGITS, output=[4])
    assert got == [2.0, -1.0, 0.5, 3.0, -1.0, 1.0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(3,))
    assert one_row(params, LOGITS, output=[0]) == [2.0, -1.0, 0.5, -INF, -2.0, -INF]
    assert one_row(params, LOGITS, output=[0, 1]) == LOGITS
    # With ignore_eos, EOS does not end the output: only the stop token is masked.
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert one_row(params, LOGITS) == [2.0, -1.0, 0.5, -INF, -2.0, 1.0]


def test_the_controls_apply_in_vllms_order() -> None:
    """min_tokens, logit_bias, then the repetition penalty (on the biased logit), then the
    frequency and presence penalties."""
    params = SamplingParams(max_tokens=4, min_tokens=1, logit_bias=((2, 1.5),),
                            repetition_penalty=2.0, frequency_penalty=1.0)
    got = one_row(params, LOGITS, prompt=[2], output=[])
    assert got == [2.0, -1.0, 1.0, 3.0, -2.0, -INF]  # (0.5 + 1.5) / 2; EOS masked
    got = one_row(params, LOGITS, prompt=[2], output=[2])
    assert got == [2.0, -1.0, 0.0, 3.0, -2.0, 1.0]  # (0.5 + 1.5) / 2 - 1


def test_rows_are_independent_and_only_controlled_rows_change() -> None:
    logits = torch.tensor([LOGITS, LOGITS])
    draws = [Draw(SamplingParams(), [], [3]), Draw(SamplingParams(presence_penalty=1.0), [], [3])]
    got = controlled(logits, draws, [EOS]).tolist()
    assert got[0] == LOGITS
    assert got[1] == [2.0, -1.0, 0.5, 2.0, -2.0, 1.0]
    assert logits.tolist() == [LOGITS, LOGITS]  # the input is not modified


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.2))
    # 0.2 x 0.5 = 0.1: the 0.05 token goes; the rest renormalised.
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(probs, expected, atol=1e-6)
    assert probabilities(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == \
        [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("min_p", 1.5), ("min_tokens", 17), ("min_tokens", -1),
    ("logit_bias", ((1, 101.0),)), ("logit_bias", ((1, 1.0), (1, 2.0))),
    ("stop_token_ids", (-1,)),
])
def test_out_of_range_controls_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})  # type: ignore[arg-type]


def test_the_engine_applies_the_controls_on_every_path(make_engine):  # type: ignore[no-untyped-def]
    """A penalty changes greedy output; a logit bias forces a token; min_tokens holds EOS off;
    and each controlled request gives the same tokens with ngram speculation and resumed from
    its first tokens elsewhere (the history is the output so far, wherever it was made)."""
    from tandem.services.engine.config import SpeculativeConfig

    plain, spec = make_engine(), make_engine(speculative=SpeculativeConfig(method="ngram"))
    prompt = chat(plain, "Repeat the word 'cat' ten times.")
    base = run(plain, prompt, SamplingParams(max_tokens=24, temperature=0.0))
    penalised = SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=1.5,
                               repetition_penalty=1.3)
    got = run(plain, prompt, penalised)
    assert got != base
    counts = {t: got.count(t) for t in got}
    assert max(counts.values()) < max(base.count(t) for t in base)
    forced = run(plain, prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                               logit_bias=((42, 100.0),)))
    assert forced == [42] * 4
    eos = plain.model_config.eos_token_ids[0]
    early = run(plain, chat(plain, "Say only: yes"), SamplingParams(max_tokens=40,
                                                                    temperature=0.0))
    assert early[-1] == eos and len(early) < 20
    held = run(plain, chat(plain, "Say only: yes"),
               SamplingParams(max_tokens=40, temperature=0.0, min_tokens=len(early) + 5))
    assert eos not in held[:len(early) + 5] and len(held) >= len(early) + 5
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=3, presence_penalty=1.0,
                             repetition_penalty=1.2, min_p=0.05, min_tokens=20)
    for params in (penalised, sampled):
        whole = run(plain, prompt, params)
        assert run(spec, prompt, params) == whole, params
        assert whole[:7] + run(spec, prompt, params, output=whole[:7]) == whole, params


def test_a_grammar_mask_leaves_only_the_allowed_tokens() -> None:
    """Bit t of the mask (little-endian 32-bit words, as llguidance writes them): token t."""
    allowed = (0b1010).to_bytes(4, "little")  # tokens 1 and 3
    logits = torch.tensor([LOGITS, LOGITS])
    draws = [Draw(SamplingParams(), [], [], allowed), Draw(SamplingParams(), [], [])]
    got = controlled(logits, draws, [EOS]).tolist()
    assert got[0] == [-INF, -1.0, -INF, 3.0, -INF, -INF]
    assert got[1] == LOGITS
