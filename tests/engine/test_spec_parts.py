"""The model-free parts of speculative decoding: prompt lookup, acceptance of drafts that match
the target's draws, the load-adaptive policy, configuration errors."""

from __future__ import annotations

import pytest

from tandem.services.engine.config import SpeculativeConfig
from tandem.services.engine.sampler import accept_matching
from tandem.services.engine.sequence import Sequence
from tandem.services.engine.speculative.ngram import lookup
from tandem.services.engine.speculative.policy import SpecPolicy
from tandem.services.protocol.request import SamplingParams


def seq(request_id: str, params: SamplingParams | None = None) -> Sequence:
    return Sequence(request_id, [1, 2, 3], 3, params or SamplingParams(), ())


def test_lookup_prefers_the_longest_and_latest_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # "5 6 7" occurred at 0-2 (followed by 8 1); "6 7" more recently at 5-6 (followed by 9).
    assert lookup(tokens, 2, 1, 3) == [8, 1]
    assert lookup(tokens, 2, 1, 2) == [9, 5]
    assert lookup(tokens, 9, 1, 3) == [8, 1, 6, 7, 9, 5, 6, 7]  # runs up to the end
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert lookup([4], 3, 1, 3) == []


def test_accept_matching():
    assert accept_matching([7, 8, 9], [7, 8]) == [7, 8, 9]  # all accepted, then a bonus
    assert accept_matching([7, 4, 9], [7, 8]) == [7, 4]  # second rejected: target's token
    assert accept_matching([3, 8, 9], [7, 8]) == [3]
    assert accept_matching([3], []) == [3]


def test_policy_shares_a_draft_budget_across_the_batch():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", k=4, max_draft_tokens_per_step=16))
    seqs = [seq(f"r{i}") for i in range(3)]
    assert policy.draft_lengths(seqs, 1) == {s.request_id: 4 for s in seqs}
    assert policy.draft_lengths(seqs, 8) == {s.request_id: 2 for s in seqs}
    assert policy.draft_lengths(seqs, 16) == {s.request_id: 1 for s in seqs}
    assert policy.draft_lengths(seqs, 17) == {}  # saturated: plain decoding
    fixed = SpecPolicy(SpeculativeConfig(method="ngram", k=4, adaptive=False))
    assert fixed.draft_lengths(seqs, 64) == {s.request_id: 4 for s in seqs}


def test_policy_honours_per_request_settings():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", k=4))
    off = seq("off", SamplingParams(speculative=False))
    capped = seq("capped", SamplingParams(num_speculative_tokens=2))
    more = seq("more", SamplingParams(num_speculative_tokens=8))  # the server's k still caps
    assert policy.draft_lengths([off, capped, more], 1) == {"capped": 2, "more": 4}


def test_policy_pauses_a_request_whose_drafts_are_rejected():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", k=4, min_acceptance=0.25))
    good, bad = seq("good"), seq("bad")

    def pause_length() -> int:
        steps = 0
        while "bad" not in policy.draft_lengths([good, bad], 2):
            steps += 1
        return steps

    for _ in range(3):  # its acceptance average falls 1 -> 0.5 -> 0.25 -> 0.125: paused
        policy.observe("bad", 4, 0)
    assert pause_length() == 16
    policy.observe("bad", 4, 0)  # the retry fails: the pause doubles
    assert pause_length() == 32
    policy.observe("bad", 4, 0)
    assert pause_length() == 64
    policy.observe("bad", 4, 4)  # a good retry keeps it going and resets the pauses
    assert policy.draft_lengths([bad], 1) == {"bad": 4}
    policy.observe("bad", 4, 0)  # one bad step after a good one is tolerated (0.31)...
    assert policy.draft_lengths([bad], 1) == {"bad": 4}
    policy.observe("bad", 4, 0)  # ...a second is not, and the pause starts short again
    assert pause_length() == 16
    assert policy.draft_lengths([good], 2) == {"good": 4}  # others were never paused


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "k": 0}, "between 1 and 16"),
    ({"method": "self", "self_draft_layers": 0}, "self_draft_layers"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ({"method": "ngram", "min_acceptance": 1.0}, "min_acceptance"),
])
def test_bad_speculative_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_bad_per_request_speculation_is_rejected():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=0)


def test_new_requests_start_from_the_engine_wide_acceptance():
    policy = SpecPolicy(SpeculativeConfig(method="self", k=4, min_acceptance=0.25))
    first = seq("first")
    assert policy.draft_lengths([first], 1) == {"first": 4}  # optimistic at the start
    for _ in range(10):  # the proposer fails for everyone
        policy.observe("first", 4, 0)
    assert policy.global_rate < 0.25
    late = seq("late")
    assert "late" not in policy.draft_lengths([late], 1), "a new request should start paused"
    steps = 1
    while "late" not in policy.draft_lengths([late], 1):
        steps += 1
    assert steps == 16  # then it probes, like any paused request
