from __future__ import annotations

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
