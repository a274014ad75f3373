"""`tandem doctor` against live clusters in the three states it must tell apart; each time its
top lever is the right one. Two clusters: 2 prefill + 1 decode workers routed round-robin
without speculation (prefix-heavy traffic, then decode-bound traffic), and one colocated engine
with a tiny KV cache (KV pressure with preemptions). Traffic is the official openai client;
the doctor measures until the traffic's requests have ended (--requests)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.cluster import UpProcess, metric_values

pytestmark = pytest.mark.timeout(400)

BLOCK = 16
PREFIX_BLOCKS = 12
PAIRS = 5  # prompts sharing a prefix, two each: round-robin sends the two to different workers


@pytest.fixture(scope="module")
def round_robin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    log = Path(tmp_path_factory.mktemp("doctor-rr")) / "tandem-up.log"
    up = UpProcess(["--prefill", "2", "--decode", "1", "--kv-transport", "tcp",
                    "--routing-policy", "round_robin", "--stats-interval", "0"], log).start()
    try:
        yield up
    finally:
        assert up.stop() == 0


@pytest.fixture(scope="module")
def tiny_kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One colocated engine whose 16 KV blocks (256 tokens) hold about two of the requests."""
    root = Path(tmp_path_factory.mktemp("doctor-kv"))
    up = UpProcess.from_settings(root, {"colocated": True, "num_kv_blocks": 16,
                                        "max_model_len": 256})
    up.args += ["--stats-interval", "0"]
    up.start()
    try:
        yield up
    finally:
        assert up.stop() == 0


def client(cluster: UpProcess) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0,
                  timeout=120)


def diagnose_during(cluster: UpProcess, requests: int, traffic: Callable[[], None]
                    ) -> dict[str, Any]:
    """`tandem doctor --json` over the window in which ``traffic`` sends ``requests``
    requests (it starts once the doctor has taken its first read)."""
    doctor = subprocess.Popen(
        [sys.executable, "-m", "tandem.services.cli", "doctor", "--url", cluster.http_url, "--json",
         "--window", "300", "--requests", str(requests), "--interval", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert doctor.stderr is not None
        first = _line(doctor.stderr, 60)
        assert first.startswith("tandem doctor: measuring"), first
        traffic()
        out, err = doctor.communicate(timeout=120)
    finally:
        if doctor.poll() is None:
            doctor.kill()
            doctor.wait(timeout=30)
    assert doctor.returncode == 0, err
    report: dict[str, Any] = json.loads(out)
    return report


def _line(stream: Any, timeout_s: float) -> str:
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return got[0] if got else ""


def top(report: dict[str, Any]) -> dict[str, Any]:
    assert report["recommended"], report["levers"]
    lever: dict[str, Any] = report["levers"][0]
    assert lever["key"] == report["recommended"][0]
    return lever


def answer(report: dict[str, Any], key: str) -> dict[str, Any]:
    found: dict[str, Any] = next(a for a in report["answers"] if a["key"] == key)
    return found


def test_prefix_heavy_traffic_with_round_robin_calls_for_prefix_routing(
        round_robin: UpProcess) -> None:
    api = client(round_robin)

    def traffic() -> None:
        for pair in range(PAIRS):
            prefix = [1000 + 37 * pair + i for i in range(PREFIX_BLOCKS * BLOCK)]
            for turn in range(2):
                api.completions.create(model="", prompt=[*prefix, 5000 + 10 * pair + turn, 7],
                                       max_tokens=2, temperature=0)

    report = diagnose_during(round_robin, 2 * PAIRS, traffic)
    lever = top(report)
    assert (lever["key"], lever["change"]) == ("prefix_routing", "--routing-policy prefix")
    prefix = answer(report, "prefix")["numbers"]
    # The second prompt of each pair finds its 12 blocks on the other worker: ~half reachable.
    assert prefix["cached on the chosen one"] == "0%"
    assert int(prefix["cached on any prefill worker"].rstrip("%")) >= 40


def test_decode_bound_traffic_without_speculation_calls_for_speculation(
        round_robin: UpProcess) -> None:
    api = client(round_robin)

    def one(i: int) -> None:
        api.completions.create(model="", prompt=f"Request {i}: count slowly from one to fifty.",
                               max_tokens=48, temperature=0, extra_body={"ignore_eos": True})

    def traffic() -> None:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, range(4)))

    report = diagnose_during(round_robin, 4, traffic)
    lever = top(report)
    assert (lever["key"], lever["change"]) == ("speculation", "--spec ngram")
    assert answer(report, "latency")["verdict"].startswith("decode dominates")


def test_kv_pressure_with_preemptions_calls_for_kv_memory(tiny_kv: UpProcess) -> None:
    api = client(tiny_kv)

    def one(i: int) -> None:
        api.completions.create(model="", prompt=f"Story {i}: once upon a time, in a land far "
                                                f"away, there lived",
                               max_tokens=64, temperature=0, extra_body={"ignore_eos": True})

    def traffic() -> None:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(6)))

    report = diagnose_during(tiny_kv, 6, traffic)
    preemptions = sum(metric_values(tiny_kv.http_url, "tandem_num_preemptions_total").values())
    assert preemptions > 0  # the state: 6 sequences growing to 5 blocks each in 16 blocks
    lever = top(report)
    assert (lever["key"], lever["change"]) == ("kv_memory", "num_kv_blocks: 32 (config)")
    assert answer(report, "memory")["verdict"].startswith("KV pressure:")
