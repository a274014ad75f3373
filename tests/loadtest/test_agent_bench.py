"""The multi-turn agent workload (loadtest/agent_bench.py) against a real gateway and engine: every
session runs every turn, each turn's prompt is the conversation so far (growing), later turns
find the earlier turns' prompt cached, and the CLI prints the medians as its last line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from tandem.loadtest.agent_bench import MODES, Workload, main, medians, run
from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.gateway.backend import EngineBackend
from tandem.services.gateway.core import Gateway
from tests.gateway.helpers import serving

WORK = Workload(sessions=3, turns=3, system_words=40, tool_words=10, output_len=4, seed=5)


@pytest.fixture(scope="module")
def url(make_engine, loaded_model: LoadedModel) -> Iterator[str]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(make_engine(num_threads=1, num_kv_blocks=256, max_model_len=2048))
    try:
        with serving(Gateway(EngineBackend(engine), loaded_model.tokenizer)) as addresses:
            yield addresses.http_url
    finally:
        engine.shutdown()


def test_sessions_grow_turn_by_turn_and_find_their_past_cached(url: str) -> None:
    results = asyncio.run(run(url, "", WORK, list(MODES), rounds=1, concurrency=2,
                              progress=False))
    assert [r.mode for r in results] == list(MODES)
    for result in results:
        assert sorted((t.session, t.turn) for t in result.turns) == [
            (s, t) for s in range(WORK.sessions) for t in range(1, WORK.turns + 1)]
        for session in range(WORK.sessions):
            turns = sorted((t for t in result.turns if t.session == session),
                           key=lambda t: t.turn)
            prompts = [t.prompt_tokens for t in turns]
            assert prompts == sorted(set(prompts)), prompts  # the conversation grows
            assert all(t.output_tokens == WORK.output_len and t.ttft_s > 0 for t in turns)
            # A later turn's prompt starts with the earlier one's: served from the cache.
            assert all(t.cached_tokens >= 16 for t in turns[1:])
        summary = result.summary()
        assert summary["turn2plus_cached_fraction"] is not None
        assert 0 < summary["turn2plus_cached_fraction"] < 1
    assert set(medians(results)) == set(MODES)


def test_the_cli_prints_the_medians_last(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--base-url", f"{url}/v1", "--sessions", "2", "--turns", "2",
                 "--concurrency", "2", "--system-words", "20", "--tool-words", "5",
                 "--output-len", "2", "--rounds", "1", "--modes", "plain"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(summary["medians"]) == ["plain"]
    assert summary["medians"]["plain"]["ttft_turn2plus_p50_s"] > 0
    with pytest.raises(SystemExit):
        main(["--modes", "sessions,fast"])
