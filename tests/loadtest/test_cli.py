"""Bad arguments fail fast with a clear message; the parser plugs into another CLI."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from tandem.loadtest.bench import cli
from tandem.loadtest.ports import free_port
from tandem.services.engine.tokenizer import Tokenizer
from tests.loadtest.peer import PeerBehaviour, serve_peer


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


BASE = ["--base-url", "http://127.0.0.1:9", "--no-progress"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-rate", "0"], "request rate must be > 0 requests/s, got 0"),
    (["--request-rate=-2"], "request rate must be > 0 requests/s, got -2"),
    (["--request-rate", "1,0"], "request rate must be > 0"),
    (["--request-rate", "often"], "invalid request rate 'often'"),
    (["--concurrency", "0"], "concurrency must be >= 1"),
    (["--concurrency", "2", "--workload", "nope"], "invalid choice: 'nope'"),
    ([], "one of the arguments --concurrency --request-rate is required"),
    (["--concurrency", "1", "--request-rate", "1"], "not allowed with argument"),
    (["--concurrency", "1", "--input-len", "0"], "invalid length '0'"),
    (["--concurrency", "1", "--num-requests", "0"], "must be > 0"),
    (["--concurrency", "1", "--slo-ttft-ms", "-5"], "must be > 0"),
])
def test_bad_arguments_are_rejected_by_the_parser(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert message in parse_error([*BASE, *argv], capsys)


@pytest.mark.parametrize(("argv", "message"), [
    (["--base-url", "ftp://127.0.0.1:1", "--concurrency", "1"], "an HTTP target is http(s)://"),
    (["--concurrency", "1"], "give the server with --base-url URL"),
    (["compare", "--target", "a=http://127.0.0.1:1", "--concurrency", "1"],
     "compare needs two or more --target"),
    (["compare", "--target", "a=http://127.0.0.1:1", "--target", "a=http://127.0.0.1:2",
      "--concurrency", "1"], "target labels must differ"),
    (["--base-url", "http://127.0.0.1:1", "--workload", "chat", "--endpoint", "completions",
      "--concurrency", "1"], "the chat workload sends message histories: use --endpoint chat"),
    (["--base-url", "grpc://127.0.0.1", "--concurrency", "1"], "a gRPC target is"),
])
def test_inconsistent_arguments_fail_before_any_traffic(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem bench: error: ") and message in err


def test_unreachable_url_fails_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    code = cli.main(["--base-url", url, "--concurrency", "1", "--num-requests", "3",
                     "--out", str(tmp_path), "--no-progress"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2
    assert f"tandem bench: error: cannot reach {url}/v1: ConnectError" in err
    assert elapsed < 15  # no retries or long timeouts (the bound is loose for a busy machine)
    assert not (tmp_path / "results.json").exists()


def test_unreachable_grpc_target_fails_fast(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import grpc  # noqa: F401  (a declared dependency)
    target = f"grpc://127.0.0.1:{free_port()}"
    code = cli.main(["--base-url", target, "--concurrency", "1", "--num-requests", "1",
                     "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "cannot reach gRPC target 127.0.0.1:" in capsys.readouterr().err


def test_a_rejected_api_key_fails_fast(tokenizer: Tokenizer, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with serve_peer(tokenizer, PeerBehaviour(api_key="right")) as (url, log):
        code = cli.main(["--base-url", url, "--api-key", "wrong", "--concurrency", "1",
                         "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "rejected the request (HTTP 401): check --api-key" in capsys.readouterr().err
    assert log.requests == 0


def test_plugs_into_a_parent_cli() -> None:
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_parser(sub)
    args = parser.parse_args(["bench", "compare", "--target", "a=http://h:1", "--target",
                              "b=http://h:2", "--request-rate", "1,2", "--workload", "mix"])
    assert args.func is cli.run
    assert (args.mode, args.request_rate, args.workload) == ("compare", [1.0, 2.0], "mix")
    args = parser.parse_args(["bench", "--base-url", "http://h:1", "--concurrency", "4"])
    assert (args.mode, args.concurrency) == ("run", [4])
