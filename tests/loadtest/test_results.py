"""docs/loadtest.md's one current-results table: the benchmarks write it (`--record`), a measure's
row replaced in place, nothing else in the file touched; every row names a command that exists."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from tandem.loadtest import peer_compare, results
from tandem.services.engine.tokenizer import Tokenizer
from tests.loadtest.test_experiments import RecordingLauncher

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / results.DOC


def test_the_documents_table_parses_with_one_row_per_measure_and_real_commands() -> None:
    rows = results.read(DOC)
    assert len(rows) >= 10
    assert len({row.measure for row in rows}) == len(rows)
    for row in rows:
        assert row.figure and row.machine and row.date, row
        for module in re.findall(r"python -m (tandem\.loadtest\.\w+)", row.command):
            assert importlib.util.find_spec(module) is not None, (row.measure, module)


def test_recording_replaces_a_measures_row_in_place_and_appends_new_ones(tmp_path: Path) -> None:
    doc = tmp_path / "loadtest.md"
    shutil.copy(DOC, doc)
    before = doc.read_text()
    old = results.read(doc)
    first = old[0]
    results.record([results.Result(first.measure, "1.23x | new", "python -m x --a 1"),
                    results.Result("a new measure", "42 tok/s", "python -m y")], doc)
    rows = results.read(doc)
    assert [r.measure for r in rows] == [r.measure for r in old] + ["a new measure"]
    assert rows[0].figure == "1.23x | new" and rows[0].command == "python -m x --a 1"
    assert rows[0].machine == results.machine() and rows[0].date.endswith("UTC")
    assert rows[1:-1] == old[1:]
    after = doc.read_text()
    begin, end = before.index(results.BEGIN), before.index(results.END)
    assert after.startswith(before[:begin]) and after.endswith(before[end:])
    # The other rows' lines as they were, whatever markdown their cells hold.
    old_lines = before[begin:end].splitlines()
    new_lines = after[begin:after.index(results.END)].splitlines()
    assert new_lines[4:-1] == old_lines[4:] and len(new_lines) == len(old_lines) + 1
    results.record([results.Result("a new measure", "43 tok/s", "`a` then `b`")], doc)
    assert results.read(doc)[-1].command == "`a` then `b`"  # kept, not wrapped again


def test_a_file_without_the_table_is_refused_by_name(tmp_path: Path) -> None:
    doc = tmp_path / "other.md"
    doc.write_text("# no table here\n")
    with pytest.raises(ValueError, match="other.md has no current-results table"):
        results.record([results.Result("m", "f", "c")], doc)
    assert doc.read_text() == "# no table here\n"


def test_the_command_leaves_out_record_and_its_file() -> None:
    assert results.command("python -m p", ["--a", "1", "--record", "x.md", "--b"]) == \
        "python -m p --a 1 --b"
    assert results.command("python -m p", ["--record", "--a", "x y"]) == "python -m p --a 'x y'"


def test_peer_compare_records_each_target_with_its_command(tokenizer: Tokenizer,
                                                           tmp_path: Path) -> None:
    doc = tmp_path / "loadtest.md"
    shutil.copy(DOC, doc)
    launcher = RecordingLauncher(tokenizer)
    argv = ["--vllm", "/bin/true", "--tandem", "default", "--num-requests", "2",
            "--prefix-requests", "2", "--rounds", "1", "--concurrency", "1,32",
            "--out", str(tmp_path / "out")]
    try:
        assert peer_compare.main([*argv, "--record", str(doc)], launch=launcher) == 0
    finally:
        launcher.close()
    recorded = [row for row in results.read(doc) if row.measure.startswith("tandem-default")]
    assert [row.measure.split(": ", 1)[1] for row in recorded] == [
        "output tok/s at c=32 vs vLLM (goal >= 1.5x)",
        "output tok/s at c=1 vs the better peer (goal >= 1x)",
        "shared-prefix TTFT p50 at c=1 vs vLLM (goal <= 0.5x)",
        "shared-prefix TTFT p50 at c=8 vs vLLM (goal <= 0.5x)"]
    assert all(row.measure.startswith("tandem-default against vLLM in bfloat16: ")
               for row in recorded)  # which of vLLM's dtypes: not the same measure
    assert all(re.match(r"\d+\.\d\dx: ", row.figure) for row in recorded)
    assert {row.command for row in recorded} == {results.command(peer_compare.PROG, argv)}
