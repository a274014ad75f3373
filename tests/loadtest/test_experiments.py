"""The comparison driver's plumbing: arguments, configurations, alternation, outputs, ratios.

Live `tandem up` clusters are not started here (the e2e suite runs the bench against one); the
driver's launcher is replaced by one that serves the test peer (a real HTTP/SSE server with a
Prometheus /metrics page) per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tandem.loadtest import experiments
from tandem.loadtest.bench.arrivals import Load
from tandem.loadtest.bench.metrics import SLO, summarize
from tandem.loadtest.bench.results import Cell
from tandem.loadtest.bench.server_metrics import CacheCounters
from tandem.loadtest.experiments import Configuration, Headline, headline_rows
from tandem.services.engine.tokenizer import Tokenizer
from tandem.services.protocol.bench_records import RequestRecord
from tandem.services.serving.config import AppConfig, ConfigError
from tests.loadtest.peer import PeerBehaviour, PeerLog, serve_peer

# -- arguments ------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    return experiments.build_parser().parse_args(argv)


@pytest.mark.parametrize(("argv", "message"), [
    (["nope"], "invalid choice: 'nope'"),
    (["disagg-vs-colocated", "--request-rate", "0"], "request rate must be > 0"),
    (["prefix-vs-roundrobin", "--cpus", "first"], "a CPU list is like 0,1 or 0-3"),
    (["prefix-vs-roundrobin", "--concurrency", "1", "--request-rate", "1"],
     "not allowed with argument"),
    (["disagg-vs-colocated", "--kv-transport", "carrier-pigeon"], "invalid choice"),
])
def test_bad_arguments_are_rejected_by_the_parser(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


class RecordingLauncher:
    """Starts the test peer for each configuration, recording launches and stops."""

    def __init__(self, tokenizer: Tokenizer, hit_fraction: dict[str, float] | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.hit_fraction = hit_fraction or {}
        self.launched: list[str] = []
        self.stopped: list[str] = []
        self.logs: dict[str, PeerLog] = {}
        self._stack = contextlib.ExitStack()

    def __call__(self, conf: Configuration, out: Path, args: argparse.Namespace) -> PeerServer:
        behaviour = PeerBehaviour(cache_hit_fraction=self.hit_fraction.get(conf.label, 0.0))
        url, log = self._stack.enter_context(serve_peer(self.tokenizer, behaviour))
        self.launched.append(conf.label)
        self.logs[conf.label] = log
        return PeerServer(conf.label, url, self)

    def close(self) -> None:
        self._stack.close()


@dataclass
class PeerServer:
    label: str
    http_url: str
    launcher: RecordingLauncher = field(repr=False)

    def stop(self) -> None:
        self.launcher.stopped.append(self.label)


@pytest.fixture
def launcher(tokenizer: Tokenizer) -> Iterator[RecordingLauncher]:
    recording = RecordingLauncher(tokenizer, {"round-robin": 0.25, "prefix-aware": 0.75})
    yield recording
    recording.close()


@pytest.mark.parametrize(("argv", "message"), [
    (["disagg-vs-colocated", "--workload", "random"],
     "disagg-vs-colocated runs the mix workload, not random"),
    (["prefix-vs-roundrobin", "--model", "/nonexistent/model.gguf"],
     "model: /nonexistent/model.gguf does not exist"),
    (["prefix-vs-roundrobin", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["disagg-vs-colocated", "--block-size", "0"], "--block-size must be >= 1"),
    (["prefix-vs-roundrobin", "--num-kv-blocks", "0"], "num_kv_blocks must be >= 1"),
    (["disagg-vs-colocated", "--slo-ttft-ms", "-1"], "must be > 0"),
])
def test_inconsistent_arguments_fail_before_any_server_starts(
        argv: list[str], message: str, launcher: RecordingLauncher, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    with contextlib.suppress(SystemExit):  # argparse's own checks exit(2) as well
        code = experiments.main([*argv, "--out", str(tmp_path / "out")], launch=launcher)
        assert code == 2
    assert message in capsys.readouterr().err
    assert launcher.launched == []
    assert not (tmp_path / "out").exists()


def test_configurations_place_threads_and_budgets_as_the_comparison_needs() -> None:
    args = parse(["disagg-vs-colocated", "--long-input-len", "700:1500", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "256"])
    confs = {c.label: c.settings for c in experiments.disagg_vs_colocated(args)}
    assert list(confs) == ["colocated", "colocated-unchunked", "disagg-1p1d"]
    for label, settings in confs.items():
        app = AppConfig.from_dict(settings, label)  # valid `tandem up --config` settings
        if label.startswith("colocated"):
            assert (app.colocated, app.threads_per_worker) == (True, 2)
        else:
            assert (app.prefill_replicas, app.decode_replicas, app.threads_per_worker,
                    app.colocated) == (1, 1, 1, False)
    assert confs["colocated"]["max_num_batched_tokens"] == 256
    assert confs["disagg-1p1d"]["max_num_batched_tokens"] == 256
    # Never chunked: the longest prompt fits beside a full batch of decoding sequences.
    assert confs["colocated-unchunked"]["max_num_batched_tokens"] == 1500 + 8

    args = parse(["prefix-vs-roundrobin", "--num-kv-blocks", "96"])
    confs = {c.label: c.settings for c in experiments.prefix_vs_roundrobin(args)}
    assert [(s["routing_policy"], s["prefill_replicas"], s["decode_replicas"],
             s["num_kv_blocks"]) for s in confs.values()] == [
        ("round_robin", 2, 1, 96), ("prefix", 2, 1, 96)]


def test_app_config_refuses_an_unknown_routing_policy() -> None:
    with pytest.raises(ConfigError, match="routing_policy must be one of prefix, round_robin, "
                                          "got 'random'"):
        AppConfig.from_dict({"routing_policy": "random"})


# -- a whole run against peers ----------------------------------------------------------------


def test_runs_alternate_and_every_output_is_written(launcher: RecordingLauncher,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["prefix-vs-roundrobin", "--num-requests", "4", "--num-tenants", "2",
            "--prefix-len", "48", "--input-len", "8", "--output-len", "3", "--concurrency", "2",
            "--rounds", "2", "--metrics-settle", "0.05", "--no-progress", "--out", str(out)]

    assert experiments.main(argv, launch=launcher) == 0

    assert launcher.launched == ["round-robin", "prefix-aware"]
    assert launcher.stopped == ["prefix-aware", "round-robin"]
    # Round 0 in configuration order, round 1 rotated: A A A A B B B B | B B B B A A A A.
    arrivals = sorted((t, label) for label, log in launcher.logs.items() for t in log.arrivals)
    order = [label for _, label in arrivals]
    assert order == (["round-robin"] * 4 + ["prefix-aware"] * 8 + ["round-robin"] * 4)

    for label in launcher.launched:
        written = yaml.safe_load((out / "configs" / f"{label}.yaml").read_text())
        AppConfig.from_dict(written, label)
    doc = json.loads((out / "results.json").read_text())
    experiment = doc["experiment"]
    assert experiment["baseline"] == "round-robin"
    assert experiment["command"].startswith(
        "python -m tandem.loadtest.experiments prefix-vs-roundrobin")
    rows = {row["label"]: row for row in experiment["headline"]}
    # The peers' /metrics report 25% and 75% of prompt tokens as hits.
    assert rows["round-robin"]["values"]["prefill hit rate (/metrics)"] == pytest.approx(0.25)
    assert rows["prefix-aware"]["values"]["prefill hit rate (/metrics)"] == pytest.approx(0.75)
    assert rows["prefix-aware"]["ratios"]["prefill hit rate (/metrics)"] == pytest.approx(3.0)
    prompt_tokens = sum(r["server_prompt_tokens"] for cell in doc["cells"]
                        if cell["label"] == "prefix-aware"
                        for run in cell["runs"] for r in run["records"])
    cache = next(c for c in doc["cells"] if c["label"] == "prefix-aware")["server_cache"]
    assert cache["prefill"]["queries"] == prompt_tokens  # only this target's own runs
    report = (out / "report.md").read_text()
    assert report.startswith("# Experiment: prefix-vs-roundrobin")
    assert "| prefix-aware | concurrency 2 | 75.0% (x3.00) |" in report
    assert "## Server prefix cache" in report
    assert (out / "ttft_cdf.png").stat().st_size > 0


# -- ratios on synthetic results ---------------------------------------------------------------


def record(index: int, kind: str, ttft: float, gap: float, tokens: int = 5,
           cached: int = 0) -> RequestRecord:
    chunks = [ttft + gap * k for k in range(tokens)]
    return RequestRecord(index, kind, "", 100, 0.0, first_token_s=ttft, end_s=chunks[-1],
                         chunk_times_s=chunks, output_tokens=tokens, server_prompt_tokens=100,
                         cached_tokens=cached)


def cell(label: str, load: Load, short_gap: float, cached: int,
         server: dict[str, CacheCounters] | None) -> Cell:
    records = [record(i, "short", 0.1, short_gap, cached=cached) for i in range(4)]
    records += [record(4, "long", 2.0, 0.05)]
    slo = SLO(ttft_ms=500)
    by_kind = {k: summarize([r for r in records if r.kind == k], 10.0, slo)
               for k in ("long", "short")}
    return Cell(label, load, [], summarize(records, 10.0, slo), by_kind, server)


def test_headline_ratios_are_each_configuration_against_the_baseline_at_its_load() -> None:
    low, high = Load("rate", 1.0), Load("rate", 2.0)
    headline = (Headline("short ITL p99", "itl.p99", "short"),
                Headline("goodput", "goodput", "all", True, "req/s"),
                Headline("prefill hits", "server_hit_rate.prefill", "all", True, "%"),
                Headline("usage hits", "client_hit_rate", "all", True, "%"),
                Headline("missing kind", "ttft.p50", "medium"))
    cells = [cell("base", low, 0.040, 0, {"prefill": CacheCounters(1000, 200)}),
             cell("other", low, 0.010, 50, {"prefill": CacheCounters(1000, 800),
                                            "decode": CacheCounters(10, 0)}),
             cell("base", high, 0.080, 0, None),
             cell("other", high, 0.020, 0, {"decode": CacheCounters(10, 0)})]

    rows = headline_rows(headline, cells)

    assert [(r["label"], r["load"]) for r in rows] == [
        ("base", "1 req/s"), ("other", "1 req/s"), ("base", "2 req/s"),
        ("other", "2 req/s")]
    assert rows[0]["ratios"] == {h.title: None for h in headline}  # the baseline itself
    low_other = rows[1]
    assert low_other["values"]["short ITL p99"] == pytest.approx(10.0)  # ms
    assert low_other["ratios"]["short ITL p99"] == pytest.approx(0.25)
    assert low_other["values"]["goodput"] == pytest.approx(0.4)  # 4 of 5 meet TTFT <= 500 ms
    assert low_other["ratios"]["goodput"] == pytest.approx(1.0)
    assert low_other["values"]["prefill hits"] == pytest.approx(0.8)
    assert low_other["ratios"]["prefill hits"] == pytest.approx(4.0)
    assert low_other["values"]["usage hits"] == pytest.approx(200 / 500)
    assert low_other["ratios"]["usage hits"] is None  # the baseline had no hits: no ratio
    assert low_other["values"]["missing kind"] is None
    high_other = rows[3]
    assert high_other["ratios"]["short ITL p99"] == pytest.approx(0.25)  # 20 / 80, not / 40
    assert high_other["values"]["prefill hits"] is None  # no prefill role in its counters
    assert headline[2].format(0.8) == "80.0%" and headline[1].format(None) == "-"


def test_tandem_vs_vllm_puts_the_peer_first_and_checks_its_python(
        launcher: RecordingLauncher, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["tandem-vs-vllm", "--vllm", "/bin/true", "--max-num-seqs", "16"])
    confs = experiments.tandem_vs_vllm(args)
    assert [(c.label, c.peer) for c in confs] == [
        ("vllm-cpu", "vllm"), ("tandem-default", None), ("tandem-1p1d", None),
        ("tandem-colocated", None)]
    assert confs[0].settings["max_num_seqs"] == 16
    assert confs[0].settings["dtype"] == "bfloat16"  # vLLM's CPU setting, not Tandem's --dtype
    assert confs[1].settings == {}  # plain `tandem up`
    for conf in confs[1:]:
        AppConfig.from_dict(conf.settings, conf.label)
    code = experiments.main(["tandem-vs-vllm", "--vllm", str(tmp_path / "missing"),
                             "--out", str(tmp_path / "out")], launch=launcher)
    assert code == 2
    assert "no such file" in capsys.readouterr().err
    assert launcher.launched == []


def test_a_vllm_server_that_exits_is_a_launch_error(tmp_path: Path) -> None:
    from tandem.loadtest.peers import VllmServer
    from tandem.loadtest.tandem_up import LaunchError

    server = VllmServer(Path("/bin/false"), tmp_path, tmp_path / "vllm.log", "m",
                        ready_timeout_s=30)
    with pytest.raises(LaunchError, match="did not become healthy"):
        server.start()
    assert server.process is not None and server.process.poll() is not None


def test_a_llama_server_that_exits_is_a_launch_error(tmp_path: Path) -> None:
    from tandem.loadtest.peers import LlamaCppServer
    from tandem.loadtest.tandem_up import LaunchError

    server = LlamaCppServer(Path("/bin/false"), tmp_path / "m.gguf", tmp_path / "llama.log",
                            "m", ready_timeout_s=30)
    with pytest.raises(LaunchError, match="llama-server did not become healthy"):
        server.start()
    assert server.process is not None and server.process.poll() is not None
