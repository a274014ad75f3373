from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from filelock import FileLock

from tandem.services.engine.config import EngineConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model_loader import LoadedModel, load_model
from tests.hf_reference import Reference, hf_greedy, load_hf_model
from tests.prompts import prompt_set

MAX_NEW_TOKENS = 32

# Every model this process runs (our engines, transformers' references) uses one torch thread:
# on these 2-core machines two collapse whenever anything else runs (measured: the exactness
# tests 441 s on two threads, 110 s on one, beside another test run; transformers' references
# 85 s -> 20 s). Clusters the tests start pick their own threads.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    return load_model(progress=False)


@pytest.fixture(scope="session")
def make_engine(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    """Build an engine on the session's weights (a fresh KV cache and scheduler each time)."""

    def make(**overrides: object) -> LLMEngine:
        config = EngineConfig(**{"num_kv_blocks": 1024, **overrides})  # type: ignore[arg-type]
        return LLMEngine(config, loaded_model)

    return make


@pytest.fixture(scope="session")
def prompts(loaded_model: LoadedModel) -> list[list[int]]:
    return prompt_set(loaded_model.tokenizer)


@pytest.fixture(scope="session")
def hf_model(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    return load_hf_model(loaded_model.source)


@pytest.fixture(scope="session")
def references(request: pytest.FixtureRequest, prompts: list[list[int]],
               tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> list[Reference]:
    """transformers' greedy tokens for the prompt set (MAX_NEW_TOKENS each, EOS ignored).

    Under `make test`'s two workers the first to ask computes them and writes them (JSON) to
    the run's temp folder, which both workers share; the other reads them there."""

    def compute() -> list[Reference]:
        hf_model = request.getfixturevalue("hf_model")
        return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]

    if worker_id == "master":  # one process: nothing to share
        return compute()
    path = tmp_path_factory.getbasetemp().parent / "hf_references.json"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return [Reference(**r) for r in json.loads(path.read_text())]
        found = compute()
        path.write_text(json.dumps([dataclasses.asdict(r) for r in found]))
        return found


# `make test` runs two pytest workers (pytest-xdist): a test file runs whole on one worker (its
# module fixtures start once), and the files that start Ray clusters run on one worker one
# after another, so that one cluster runs at a time, beside the other worker's single-threaded
# tests. (xdist's own --dist loadgroup cannot do this under pytest 9.2: the group it appends to
# a test's node id no longer takes.)
RAY_FILES = ("tests/e2e/", "tests/serving/test_route_to.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndRay(LoadScopeScheduling):  # type: ignore[misc]
        """Scopes: the Ray-starting files together, every other file on its own; the largest
        scope (the Ray one) goes out first."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path.startswith(RAY_FILES) else path

    return FilesAndRay(config, log)


SLOWEST_MODULES = 20


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The test files that took longest, every phase counted (a module's shared cluster starts
    in its first test's setup): where CI's time goes."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                module = report.nodeid.split("::")[0]
                totals[module] = totals.get(module, 0.0) + report.duration
    if not totals:
        return
    terminalreporter.write_sep("=", f"slowest {SLOWEST_MODULES} test files (s)")
    for module, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:SLOWEST_MODULES]:
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
    ray = sum(seconds for module, seconds in totals.items() if module.startswith(RAY_FILES))
    terminalreporter.write_line(f"{ray:8.1f}  the Ray files (on one worker, one after another)")
    terminalreporter.write_line(f"{sum(totals.values()):8.1f}  all {len(totals)} files")
