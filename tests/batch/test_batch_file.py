"""`tandem batch`'s checks of its input and output files: refused before any request is sent
(exit 2), each message naming the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.services.batch.batch_file import read_done
from tandem.services.cli import main as tandem
from tests.batch.requests import batch_lines, write_jsonl

GOOD = batch_lines(2)


def _with(**changes: object) -> dict[str, object]:
    line: dict[str, object] = {**GOOD[1], **changes}
    return {k: v for k, v in line.items() if v is not None}


@pytest.mark.parametrize(("bad_line", "expected"), [
    ("{not json", ":3: not valid JSON"),
    ("[1, 2]", ":3: must be a JSON object"),
    (_with(custom_id=None), ":3: custom_id: is missing"),
    (_with(custom_id=""), ":3: custom_id: must be a non-empty string"),
    (_with(custom_id=GOOD[0]["custom_id"]), ":3: custom_id: 'req-000' is already used on line 1"),
    (_with(method="GET"), ":3: method: must be \"POST\", got 'GET'"),
    (_with(url="/v1/embeddings"), ":3: url: must be one of /v1/chat/completions, "
                                  "/v1/completions, got '/v1/embeddings'"),
    (_with(body=[]), ":3: body: must be a JSON object"),
    (_with(body={**GOOD[1]["body"], "stream": True}), ":3: body.stream: streaming is not "
                                                      "supported"),
    (_with(extra=1), ":3: extra: unknown field"),
])
def test_a_bad_input_line_is_refused_by_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad_line: object,
        expected: str) -> None:
    text = bad_line if isinstance(bad_line, str) else json.dumps(bad_line)
    source = tmp_path / "in.jsonl"
    source.write_text(f"{json.dumps(GOOD[0])}\n\n{text}\n")  # a blank line is skipped
    output = tmp_path / "out.jsonl"

    assert tandem(["batch", "--input", str(source), "--output", str(output)]) == 2

    assert f"tandem: error: {source}{expected}" in capsys.readouterr().err
    assert not output.exists()  # nothing was run


def test_an_output_of_another_batch_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", GOOD)
    output = tmp_path / "out.jsonl"
    output.write_text(json.dumps({"custom_id": "elsewhere"}) + "\n")

    assert tandem(["batch", "--input", str(source), "--output", str(output)]) == 2

    assert (f"{output}:1: custom_id: 'elsewhere' is not in the input; is it this batch's "
            f"output? (--restart starts it over)") in capsys.readouterr().err


def test_a_torn_last_line_is_cut_off(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    whole = json.dumps({"custom_id": "a", "response": None}) + "\n"
    output.write_text(whole + '{"custom_id": "b", "resp')

    assert read_done(output, {"a", "b"}) == ({"a"}, set())
    assert output.read_text() == whole


def _output_line(custom_id: str, error: bool) -> str:
    return json.dumps({"custom_id": custom_id, "response": None,
                       "error": {"code": "timeout", "message": "m"} if error else None}) + "\n"


def test_the_last_line_of_a_custom_id_holds_after_errors_only(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text(_output_line("a", True) + _output_line("b", True) + _output_line("c", False)
                      + _output_line("a", True) + _output_line("a", False))

    assert read_done(output, {"a", "b", "c"}) == ({"a", "c"}, {"b"})


@pytest.mark.parametrize("error", [False, True])
def test_a_line_after_an_answer_is_refused(tmp_path: Path, error: bool) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text(_output_line("a", False) + _output_line("a", error))

    with pytest.raises(ValueError, match=f"{output}:2: custom_id: 'a' is answered twice"):
        read_done(output, {"a"})
