"""The one table of current results in docs/loadtest.md, written by the benchmarks.

A benchmark run with ``--record`` puts its headline figures into the table between the two
markers below: a row per measure, replacing that measure's row if it is there (the newest figure
stands; older runs live in commit messages), each with the machine it ran on, the command that
reproduces it and the time. Nothing else in the file changes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DOC = Path("docs/loadtest.md")
BEGIN = "<!-- results: rows written by `--record` (tandem.loadtest.results) -->"
END = "<!-- results end -->"
COLUMNS = ("measure", "figure", "machine", "command", "date")


@dataclass(frozen=True)
class Result:
    measure: str  # what is measured, with its setting; the row's key
    figure: str
    command: str  # what reproduces it
    machine: str = ""
    date: str = ""


def machine() -> str:
    """This machine in a few words: CPUs, model, the widest vector unit our kernels use."""
    model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = next((name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"),
                                        ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), "")
    return ", ".join(part for part in (f"{os.cpu_count()} CPUs", model, isa) if part)


def command(prog: str, argv: Sequence[str]) -> str:
    """The command line that reproduces a run: ``prog`` and its arguments, less ``--record``."""
    kept, skip = [], False
    for arg in argv:
        if skip and arg.endswith(".md"):  # --record's file
            skip = False
            continue
        skip = arg == "--record"
        if not (skip or arg.startswith("--record=")):
            kept.append(arg)
    return " ".join([prog, shlex.join(kept)]).strip()


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", nargs="?", type=Path, const=DOC, default=None,
                        metavar="FILE",
                        help=f"write the headline figures into FILE's current-results table "
                             f"(default {DOC}, from the repository root)")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _row(result: Result) -> str:
    command = result.command if "`" in result.command else f"`{result.command}`"
    cells = (result.measure, result.figure, result.machine, command, result.date)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _parse_row(line: str) -> Result:
    cells, cell, escaped = [], "", False
    for char in line.strip().strip("|"):
        if escaped:
            cell, escaped = cell + char, False
        elif char == "\\":
            escaped = True
        elif char == "|":
            cells, cell = [*cells, cell.strip()], ""
        else:
            cell += char
    cells.append(cell.strip())
    if len(cells) != len(COLUMNS):
        raise ValueError(f"results table row has {len(cells)} cells, not {len(COLUMNS)}: {line}")
    measure, figure, where, cmd, date = cells
    if cmd.count("`") == 2 and cmd.startswith("`") and cmd.endswith("`"):
        cmd = cmd[1:-1]  # a command alone; other cells keep their markdown
    return Result(measure, figure, cmd, where, date)


def _table_span(lines: list[str], doc: Path) -> tuple[int, int]:
    try:
        begin, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise ValueError(f"{doc} has no current-results table (the lines {BEGIN!r} and "
                         f"{END!r})") from None
    if end < begin + 3:
        raise ValueError(f"{doc}: the current-results table has no header")
    return begin, end


def read(doc: Path = DOC) -> list[Result]:
    """The table's rows, in order."""
    lines = doc.read_text().splitlines()
    begin, end = _table_span(lines, doc)
    return [_parse_row(line) for line in lines[begin + 3:end]]


def record(results: Sequence[Result], doc: Path = DOC) -> None:
    """Puts ``results`` into ``doc``'s table: a measure's row replaced in place, new ones last,
    each stamped with this machine and the time where it has none; the other rows' lines are
    left as they are."""
    text = doc.read_text()
    lines = text.splitlines()
    begin, end = _table_span(lines, doc)
    rows = {_parse_row(line).measure: line for line in lines[begin + 3:end]}
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    here = machine()
    for result in results:
        rows[result.measure] = _row(Result(result.measure, result.figure, result.command,
                                           result.machine or here, result.date or now))
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS), *rows.values()]
    out = [*lines[:begin + 1], *table, *lines[end:]]
    doc.write_text("\n".join(out) + ("\n" if text.endswith("\n") else ""))
    print(f"recorded {len(results)} row(s) in {doc}")
