"""`tandem batch`'s output file: a second run on the same output refused while the first holds
it (real processes, against tests/batch/flaky_server.py, a real HTTP server process answering
on each request's plan); the lines fsynced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tandem.services.batch.batch_file import FSYNC_INTERVAL_S, Output
from tests.batch.flaky_server import flaky_server
from tests.batch.requests import read_jsonl, write_jsonl
from tests.gateway.helpers import wait_until

TANDEM = Path(sys.executable).with_name("tandem")


def _planned(plans: dict[str, str]) -> list[dict[str, Any]]:
    """A completion request per ``custom_id``, its ``user`` naming its plan."""
    return [{"custom_id": name, "method": "POST", "url": "/v1/completions",
             "body": {"prompt": name, "max_tokens": 1, "user": f"{name}:{plan}"}}
            for name, plan in plans.items()]


def _tries(url: str) -> dict[str, int]:
    return {plan.split(":")[0]: n for plan, n in httpx.get(f"{url}/tries").json().items()}


def test_a_second_run_on_the_same_output_is_refused_while_the_first_holds_it(
        tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", _planned({"slow": "hang,200"}))
    output = tmp_path / "out.jsonl"
    with flaky_server() as url:
        command = [str(TANDEM), "batch", "--input", str(source), "--output", str(output),
                   "--base-url", url, "--no-progress"]
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        try:  # its request sent, so its output locked; the server never answers it
            wait_until(lambda: _tries(url).get("slow") == 1 or first.poll() is not None,
                       "the first run's request", timeout_s=60)
            assert first.poll() is None, first.communicate()[1]

            second = subprocess.run(command, capture_output=True, text=True, timeout=60)

            assert second.returncode == 2, second.stderr
            assert (f"tandem: error: {output}: another tandem batch run is writing this output "
                    f"(it holds the file's lock)") in second.stderr
            assert first.poll() is None and _tries(url)["slow"] == 1  # the second sent nothing
        finally:
            first.kill()
            first.wait()
        assert output.read_text() == ""

        # The lock went with the killed process: the next run takes it, and goes on.
        third = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert third.returncode == 0, third.stderr
    assert [line["response"]["status_code"] for line in read_jsonl(output)] == [200]


def test_written_lines_are_fsynced_within_the_interval_and_the_lock_released_on_close(
        tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with Output(path) as out:
        out.write({"custom_id": "a"})
        assert out.unsynced_lines == 1
        wait_until(lambda: out.unsynced_lines == 0, "the fsync thread",
                   timeout_s=30 * FSYNC_INTERVAL_S)
        out.write({"custom_id": "b"})
    assert out.unsynced_lines == 0  # close syncs the rest
    with Output(path):  # and releases the lock
        pass
    assert [line["custom_id"] for line in read_jsonl(path)] == ["a", "b"]
