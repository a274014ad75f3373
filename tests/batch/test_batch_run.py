"""`tandem batch` end to end: a real subprocess on the built-in model, killed halfway and run
again; against a running gateway with --base-url. Every answer is compared with what the
online HTTP API gives for the same request."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.services.cli import main as tandem
from tandem.services.gateway.runner import ServeAddresses
from tests.batch.conftest import API_KEY
from tests.batch.requests import batch_lines, read_jsonl, write_jsonl
from tests.e2e.cluster import static_server
from tests.gateway.helpers import wait_until

TANDEM = Path(sys.executable).with_name("tandem")
REQUESTS = 100


def _complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _online_answers(server: ServeAddresses, lines: list[dict[str, Any]]
                    ) -> dict[str, httpx.Response]:
    """Each request sent to the online API over HTTP, 32 at a time."""

    async def send_all() -> dict[str, httpx.Response]:
        slots = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=server.http_url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:

            async def send(line: dict[str, Any]) -> tuple[str, httpx.Response]:
                async with slots:
                    return line["custom_id"], await client.post(line["url"], json=line["body"])

            return dict(await asyncio.gather(*(send(line) for line in lines)))

    return asyncio.run(send_all())


def _same_answer(batch_body: dict[str, Any], online_body: dict[str, Any]) -> None:
    """Ids, timestamps and cached-token counts differ between two runs; nothing else may."""
    assert batch_body["object"] == online_body["object"]
    assert batch_body["choices"] == online_body["choices"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert ({k: batch_body["usage"][k] for k in counts}
            == {k: online_body["usage"][k] for k in counts})


def test_a_killed_batch_resumes_and_answers_every_request_once_as_online(
        tmp_path: Path, online: ServeAddresses) -> None:
    lines = batch_lines(REQUESTS)
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    command = [str(TANDEM), "batch", "--input", str(source), "--output", str(output),
               "--threads", "1", "--no-progress"]
    with (tmp_path / "first.err").open("w") as err:
        first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_until(lambda: _complete_lines(output) >= REQUESTS // 2 or first.poll() is not None,
                       "half the batch answered", timeout_s=300)
        finally:
            first.kill()
            first.wait()
    killed_at = _complete_lines(output)
    assert REQUESTS // 2 <= killed_at < REQUESTS, (tmp_path / "first.err").read_text()
    # A line cut short as if the kill had come mid-write, of a request not answered yet.
    answered = {line["custom_id"] for line in read_jsonl(output)}
    torn_id = next(line["custom_id"] for line in lines if line["custom_id"] not in answered)
    with output.open("a") as out:
        out.write(json.dumps({"id": "batch_req_torn", "custom_id": torn_id})[:30])

    second = subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert second.returncode == 0, second.stderr
    assert f"{REQUESTS - killed_at} requests (0 failed)" in second.stderr
    assert f"{killed_at} answered before" in second.stderr
    results = read_jsonl(output)  # every line whole: the torn one was cut off
    assert Counter(r["custom_id"] for r in results) == {line["custom_id"]: 1 for line in lines}
    online_answers = _online_answers(online, lines)
    for result in results:
        assert result["id"].startswith("batch_req_") and result["error"] is None
        response = result["response"]
        assert response["status_code"] == 200
        assert response["request_id"] == response["body"]["id"]
        reference = online_answers[result["custom_id"]]
        assert reference.status_code == 200
        _same_answer(response["body"], reference.json())


def test_ctrl_c_stops_cleanly_and_keeps_the_answered_lines(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", batch_lines(REQUESTS))
    output = tmp_path / "out.jsonl"
    # A job a shell starts in the background (CI's may be one) ignores SIGINT, and so would
    # this child, as Ctrl-C's convention wants: it is started with SIGINT's default action.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # reset by exec
    try:
        process = subprocess.Popen([str(TANDEM), "batch", "--input", str(source), "--output",
                                    str(output), "--threads", "1", "--no-progress"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_until(lambda: _complete_lines(output) >= 1 or process.poll() is not None,
                   "a first answer", timeout_s=300)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()

    assert process.returncode == 130, err
    assert "interrupted; the answered requests are in" in err and "Traceback" not in err
    assert 1 <= len(read_jsonl(output)) < REQUESTS  # whole lines only


def test_base_url_sends_to_a_running_gateway_and_records_a_refused_line(
        tmp_path: Path, online: ServeAddresses, capsys: pytest.CaptureFixture[str]) -> None:
    lines = batch_lines(4)
    lines[1]["body"]["temperature"] = -1  # the gateway's own 400
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"

    code = tandem(["batch", "--input", str(source), "--output", str(output), "--base-url",
                   f"{online.http_url}/v1", "--api-key", API_KEY, "--no-progress"])

    assert code == 1  # a request failed; its line is written all the same
    assert "4 requests (1 failed)" in capsys.readouterr().err
    results = {r["custom_id"]: r for r in read_jsonl(output)}
    assert set(results) == {line["custom_id"] for line in lines}
    refused = results.pop(lines[1]["custom_id"])
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["param"] == "temperature" and "greater than or equal to 0" in error["message"]
    online_answers = _online_answers(online, [line for line in lines if line is not lines[1]])
    for custom_id, result in results.items():
        assert result["response"]["status_code"] == 200
        _same_answer(result["response"]["body"], online_answers[custom_id].json())


def test_resume_skips_what_is_answered_and_restart_starts_over(
        tmp_path: Path, online: ServeAddresses, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", batch_lines(3))
    output = tmp_path / "out.jsonl"
    command = ["batch", "--input", str(source), "--output", str(output), "--base-url",
               online.http_url, "--api-key", API_KEY, "--no-progress"]
    assert tandem(command) == 0
    first = output.read_text()

    assert tandem(command) == 0
    assert "all 3 requests already answered" in capsys.readouterr().err
    assert output.read_text() == first

    assert tandem([*command, "--restart"]) == 0
    assert "3 requests (0 failed)" in capsys.readouterr().err
    again = read_jsonl(output)  # three new lines, not six
    assert sorted(r["custom_id"] for r in again) == ["req-000", "req-001", "req-002"]
    assert output.read_text() != first


@pytest.mark.parametrize(("url", "key", "expected"), [
    ("http://127.0.0.1:9", API_KEY, "http://127.0.0.1:9 does not answer (ConnectError"),
    (None, "sk-wrong", "/v1/models answered 401"),
])
def test_a_server_that_cannot_be_used_is_refused_before_any_request(
        tmp_path: Path, online: ServeAddresses, capsys: pytest.CaptureFixture[str],
        url: str | None, key: str, expected: str) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", batch_lines(2))
    output = tmp_path / "out.jsonl"

    code = tandem(["batch", "--input", str(source), "--output", str(output), "--base-url",
                   url or online.http_url, "--api-key", key, "--no-progress"])

    assert code == 2
    assert expected in capsys.readouterr().err
    assert not output.exists()


def test_a_hung_server_is_refused_within_the_timeout(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A server process stopped with SIGSTOP (it accepts connections, answers nothing): the
    check before any request ends after --timeout, exit 2, nothing written."""
    source = write_jsonl(tmp_path / "in.jsonl", batch_lines(2))
    output = tmp_path / "out.jsonl"
    (tmp_path / "health").write_text("{}")
    with static_server(tmp_path, "/health") as (url, server):
        server.send_signal(signal.SIGSTOP)
        code = tandem(["batch", "--input", str(source), "--output", str(output), "--base-url",
                       url, "--timeout", "1", "--no-progress"])
    assert code == 2
    assert f"{url} does not answer (ReadTimeout" in capsys.readouterr().err
    assert not output.exists()
