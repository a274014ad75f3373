from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.services.gateway.pipeline import StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        result = matcher.feed(piece)
        out.append(result.text)
        if result.stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_no_stops_passes_text_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_stop_inside_one_piece_cuts_before_it() -> None:
    assert run(["END"], ["abcENDxyz"]) == (["abc"], True)


def test_stop_split_across_pieces_is_held_back_then_cut() -> None:
    out, stopped = run(["\n\n"], ["Paris.", "\n", "\nThe"])
    assert stopped
    assert out == ["Paris.", "", ""]


def test_a_false_start_is_released() -> None:
    out, stopped = run(["STOP"], ["go ST", "OP!"[:1] + "x", " more"])
    assert not stopped
    assert "".join(out) == "go STOx more"
    assert out[0] == "go "  # "ST" was held back until it could not be a stop


def test_earliest_of_several_stops_wins() -> None:
    assert run(["cd", "b"], ["abcd"]) == (["a"], True)


def test_held_back_text_is_flushed_at_the_end() -> None:
    assert run(["xyz"], ["abcxy"]) == (["abc", "xy"], False)


def test_nothing_after_a_stop() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("a.b").text == "a"
    assert matcher.feed("more").text == ""
    assert matcher.flush() == ""


class NaiveStops:
    """The obvious matcher (search the unsent text for every stop, hold back the longest suffix
    that begins one): quadratic in long stops, the reference for the linear one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        pending = self.pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            return pending[:min(hits)], True
        hold = max((k for s in self.stops for k in range(1, min(len(pending), len(s) - 1) + 1)
                    if pending.endswith(s[:k])), default=0)
        self.pending = pending[len(pending) - hold:]
        return pending[:len(pending) - hold], False


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text("ab\n", min_size=1, max_size=6), max_size=4),
       pieces=st.lists(st.text("ab\n", max_size=5), max_size=12))
def test_the_linear_matcher_emits_what_the_naive_one_does(stops: list[str],
                                                          pieces: list[str]) -> None:
    # A two-letter alphabet makes overlaps, repeats and stops inside stops common.
    naive, out = NaiveStops(stops), []
    for piece in pieces:
        text, stopped = naive.feed(piece)
        out.append(text)
        if stopped:
            break
    else:
        stopped = False
        if naive.stops:
            out.append(naive.pending)
        else:
            out.append("")
    assert run(stops, pieces) == (out, stopped)


def test_long_stop_strings_cost_linear_time_per_character() -> None:
    # 16 stops of 1024 characters that every generated character partly matches: the naive
    # matcher compares ~16 x 1024^2 / 2 characters per piece; this one a few per character.
    stops = ["a" * 1023 + str(i % 10) for i in range(16)]
    matcher = StopStringMatcher(stops)
    emitted = "".join(matcher.feed("a").text for _ in range(5000))
    assert emitted == "a" * (5000 - 1023)  # the last 1023 a's may begin a stop: held
    assert matcher.flush() == "a" * 1023
