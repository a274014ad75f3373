"""`tandem batch` against a server that fails (tests/batch/flaky_server.py, a real HTTP server
process failing on each request's plan): server faults retried, then recorded as error lines
that --retry-failed sends again; a server gone stops the run; a second run on the same output
refused while the first holds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.services.batch import runner
from tandem.services.batch.batch_file import FSYNC_INTERVAL_S, Output, read_done
from tandem.services.cli import main as tandem
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


def test_faults_are_retried_then_recorded_and_retry_failed_sends_those_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = {"after-500": "500,200", "after-429": "429,429,200", "after-timeout": "hang,200",
             "refused": "400", "server-error": "502,502,502,502,200",
             "no-connection": "close,close,close,close,200"}
    source = write_jsonl(tmp_path / "in.jsonl", _planned(plans))
    output = tmp_path / "out.jsonl"
    with flaky_server() as url:
        command = ["batch", "--input", str(source), "--output", str(output), "--base-url", url,
                   "--timeout", "2", "--no-progress"]

        assert tandem(command) == 1
        assert "6 requests (3 failed, 2 without an answer)" in capsys.readouterr().err
        assert _tries(url) == {"after-500": 2, "after-429": 3, "after-timeout": 2, "refused": 1,
                               "server-error": runner.FAULT_ATTEMPTS,
                               "no-connection": runner.FAULT_ATTEMPTS}
        lines = {line["custom_id"]: line for line in read_jsonl(output)}
        assert len(lines) == 6
        for name in ("after-500", "after-429", "after-timeout"):
            assert lines[name]["error"] is None and lines[name]["response"]["status_code"] == 200
        assert lines["refused"]["error"] is None  # the request is wrong: final at once
        assert lines["refused"]["response"]["status_code"] == 400
        server_error = lines["server-error"]
        assert server_error["response"]["status_code"] == 502
        assert server_error["error"]["code"] == "server_error"
        assert server_error["error"]["message"].startswith("HTTP 502: ")
        assert server_error["error"]["message"].endswith("(after 4 tries)")
        no_connection = lines["no-connection"]
        assert no_connection["response"] is None
        assert no_connection["error"]["code"] == "connection_error"
        assert no_connection["error"]["message"].startswith("RemoteProtocolError: ")

        assert tandem(command) == 0  # a plain resume: the error lines are results too
        assert ("all 6 requests already answered in" in (err := capsys.readouterr().err)
                and "(2 with an error line: --retry-failed sends them again)" in err)

        assert tandem([*command, "--retry-failed"]) == 0
        err = capsys.readouterr().err
        assert "2 requests (0 failed)" in err and "; 4 answered before" in err
        tries = _tries(url)
        assert tries["server-error"] == tries["no-connection"] == runner.FAULT_ATTEMPTS + 1
        assert tries["refused"] == 1 and tries["after-500"] == 2  # not sent again

        assert tandem([*command, "--retry-failed"]) == 0
        assert "all 6 requests already answered in" in capsys.readouterr().err
    results = read_jsonl(output)  # the new lines appended: the last of a custom_id holds
    assert [r["custom_id"] for r in results[6:]] in (["server-error", "no-connection"],
                                                     ["no-connection", "server-error"])
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results[6:])
    assert read_done(output, set(plans)) == (set(plans), set())


def test_a_server_gone_stops_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    count = 2 * runner.STOP_AFTER_ERRORS
    source = write_jsonl(tmp_path / "in.jsonl", _planned({f"r{i:02d}": "close"
                                                          for i in range(count)}))
    output = tmp_path / "out.jsonl"
    with flaky_server() as url:
        code = tandem(["batch", "--input", str(source), "--output", str(output), "--base-url",
                       url, "--concurrency", str(runner.STOP_AFTER_ERRORS), "--no-progress"])

    assert code == 1
    err = capsys.readouterr().err
    assert (f"stopped, the server is gone: {runner.STOP_AFTER_ERRORS} requests in a row got no "
            f"answer (the last: RemoteProtocolError: ") in err
    lines = read_jsonl(output)  # the rest have no line: the next run sends them
    assert len(lines) == runner.STOP_AFTER_ERRORS
    assert all(line["error"]["code"] == "connection_error" for line in lines)


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
