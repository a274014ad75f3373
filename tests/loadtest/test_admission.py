"""`tandem bench` against Tandem's real gateway (a colocated engine on the built-in model) with
room for one request: what the gateway refuses with 429 + Retry-After is counted as rejected,
over HTTP and gRPC, and neither as completed nor as failed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.loadtest.bench import cli
from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.core import Gateway
from tandem.services.gateway.runner import ServeAddresses
from tests.gateway.helpers import serving, wait_until

SMALL = ["--no-progress", "--input-len", "16", "--output-len", "4", "--seed", "3"]
# Holds the one slot while the bench runs (hundreds of decode steps; it is aborted at the end).
LONG = {"prompt": "Tell me a long story.", "max_tokens": 900, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def gateway(make_engine, loaded_model: LoadedModel  # type: ignore[no-untyped-def]
            ) -> Iterator[Gateway]:
    engine = AsyncEngine(make_engine(num_threads=1, num_kv_blocks=128, max_model_len=1024))
    yield Gateway(EngineBackend(engine), loaded_model.tokenizer, GatewayConfig(max_in_flight=1))
    engine.shutdown()


@pytest.fixture(scope="module")
def server(gateway: Gateway) -> Iterator[ServeAddresses]:
    with serving(gateway) as addresses:
        yield addresses


def summary(out: Path) -> dict[str, Any]:
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert len(cells) == 1
    return dict(cells[0]["summary"], records=[r for run in cells[0]["runs"]
                                              for r in run["records"]])


def test_429s_are_rejected_not_failed(server: ServeAddresses, gateway: Gateway,
                                      tmp_path: Path) -> None:
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=LONG,
                      timeout=60) as held:
        assert held.status_code == 200 and gateway.in_flight == 1
        for name, url in (("http", server.http_url), ("grpc", f"grpc://{server.grpc_target}")):
            code = cli.main(["--base-url", url, "--num-requests", "3", "--request-rate", "inf",
                             "--out", str(tmp_path / name), *SMALL])
            assert code == 1  # nothing completed
            s = summary(tmp_path / name)
            assert (s["completed"], s["failed"], s["rejected"], s["mid_stream_errors"]) == \
                (0, 0, 3, 0), s["records"]
            assert all(r["rejected"] and not r["admitted"] for r in s["records"])
            assert s["errors"] == {}
            assert "3 rejected as overloaded" in (tmp_path / name / "report.md").read_text()
    wait_until(lambda: gateway.in_flight == 0, "the held stream to end")

    assert cli.main(["--base-url", server.http_url, "--num-requests", "2", "--concurrency", "1",
                     "--out", str(tmp_path / "free"), *SMALL]) == 0
    s = summary(tmp_path / "free")
    assert (s["completed"], s["failed"], s["rejected"], s["mid_stream_errors"]) == (2, 0, 0, 0)
    assert all(r["admitted"] and not r["rejected"] for r in s["records"])
