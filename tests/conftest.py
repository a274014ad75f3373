from __future__ import annotations

import pytest
import torch

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
def references(hf_model, prompts: list[list[int]]) -> list[Reference]:  # type: ignore[no-untyped-def]
    """transformers' greedy tokens for the prompt set (MAX_NEW_TOKENS each, EOS ignored)."""
    return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]


# `make test` runs two pytest workers (pytest-xdist, `--dist loadgroup`), a group on one worker,
# whole and in order: each test file is a group of its own (its module fixtures start once), and
# the files that start Ray clusters (tests/e2e/ and those marked xdist_group(RAY_GROUP)) share
# one, so that one cluster runs at a time, beside the other worker's single-threaded tests.
RAY_GROUP = "ray"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = RAY_GROUP if "e2e" in item.path.parts else item.path.stem
            item.add_marker(pytest.mark.xdist_group(group))


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
    terminalreporter.write_line(f"{sum(totals.values()):8.1f}  all {len(totals)} files")
