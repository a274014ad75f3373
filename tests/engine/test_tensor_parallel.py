"""Tensor parallelism on a CPU: two real processes over gloo give one rank's greedy tokens (the
built-in model's 3 KV heads split 2 + 1, so the split is uneven); a follower killed mid-life
stops the engine with a clear error, within the collective timeout; settings it cannot serve
are refused by name."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
from torch._C._distributed_c10d import PythonCallbackWork

from tandem.services.engine.async_engine import AsyncEngine
from tandem.services.engine.config import EngineConfig, SpeculativeConfig
from tandem.services.engine.llm_engine import LLMEngine
from tandem.services.engine.model import Shard, split_evenly
from tandem.services.engine.model_loader import LoadedModel
from tandem.services.engine.tensor_parallel import TensorParallelError, wait_all_reduce
from tandem.services.handoff.staging import TransferArea
from tandem.services.protocol.outputs import EngineDeadError
from tandem.services.protocol.request import GenerationRequest, SamplingParams
from tests.engine.helpers import chat

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# A small chunk, so the long prompt takes several steps (chunked prefill across the ranks).
ENGINE = {"num_kv_blocks": 160, "max_num_batched_tokens": 64, "num_threads": 1,
          "max_model_len": 512}


@pytest.fixture(scope="module")
def two_ranks(loaded_model: LoadedModel) -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(**ENGINE, tensor_parallel_size=2), loaded_model)
    yield engine
    engine.close()
    assert engine.tp is not None
    assert [p.returncode for p in engine.tp.followers] == [0]  # stopped, cleanly


def test_the_ranks_rendezvous_listens_on_loopback_only(two_ranks: LLMEngine) -> None:
    assert two_ranks.tp is not None
    port = two_ranks.tp._store.port
    listening = [c.laddr for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [address.ip for address in listening] == ["127.0.0.1"]


def test_uneven_split() -> None:
    assert [split_evenly(3, 2, r) for r in range(2)] == [range(0, 2), range(2, 3)]
    assert [split_evenly(1536, 2, r) for r in range(2)] == [range(0, 768), range(768, 1536)]


def test_greedy_tokens_equal_one_rank(two_ranks: LLMEngine, loaded_model: LoadedModel,
                                      prompts: list[list[int]]) -> None:
    one_rank = LLMEngine(EngineConfig(**ENGINE), loaded_model)
    short, long = chat(one_rank, "What is the capital of France?"), prompts[3]  # 227 tokens
    shared = long[:160] + chat(one_rank, "Now say it in French.")
    assert two_ranks.model_config.num_kv_heads == 3
    assert two_ranks.kv_cache.shape[4] == 2  # rank 0's heads; rank 1 holds the third
    batch = [short, long, shared]
    assert two_ranks.generate(batch, GREEDY) == one_rank.generate(batch, GREEDY)
    hits = two_ranks.stats.prefix_cache_hits
    assert two_ranks.generate([shared], GREEDY) == one_rank.generate([shared], GREEDY)
    assert two_ranks.stats.prefix_cache_hits > hits  # its prefix came from both ranks' caches


def test_staging_holds_imports_until_full_and_takes_every_block_back(
        two_ranks: LLMEngine, prompts: list[list[int]]) -> None:
    """A two-rank engine's transfer area (services/handoff/staging.py): a quarter of the 160
    blocks (40, more than a 512-token context); imports of 15 blocks each fit twice."""
    area = TransferArea(two_ranks)
    assert area.staged and area.num_staging == 40
    prompt = prompts[3][::-1]  # 227 tokens (15 blocks), none of them cached
    free = two_ranks.stats.num_free_blocks
    staged = []
    for i in range(3):
        slot = two_ranks.begin_import(GenerationRequest(f"import-{i}", prompt, SamplingParams()),
                                      1)
        staged.append(area.reserve(f"import-{i}", slot.filled_block_ids))
    assert [None if ids is None else len(ids) for ids in staged] == [15, 15, None]
    assert area.num_free == 40 - 30
    area.free("import-0")
    two_ranks.recompute_import("import-0")
    for i in range(3):
        assert two_ranks.abort_request(f"import-{i}")
        area.free(f"import-{i}")
    assert area.num_free == 40 and two_ranks.stats.num_free_blocks == free


def test_int8_kv_greedy_tokens_equal_one_rank(loaded_model: LoadedModel,
                                              prompts: list[list[int]]) -> None:
    config = {**ENGINE, "kv_cache_dtype": "int8"}
    two = LLMEngine(EngineConfig(**config, tensor_parallel_size=2), loaded_model)
    try:
        one = LLMEngine(EngineConfig(**config), loaded_model)
        batch = [prompts[0], prompts[3]]
        assert two.generate(batch, GREEDY) == one.generate(batch, GREEDY)
    finally:
        two.close()


def test_ngram_drafts_verify_across_ranks(loaded_model: LoadedModel) -> None:
    """Verification steps (decodes of 1 + k query rows) run on both ranks alike."""
    ngram = SpeculativeConfig(method="ngram", k=3)
    two = LLMEngine(EngineConfig(**ENGINE, tensor_parallel_size=2, speculative=ngram),
                    loaded_model)
    try:
        one = LLMEngine(EngineConfig(**ENGINE), loaded_model)
        prompt = chat(one, "Repeat after me: one two three four, one two three four, one two")
        assert two.generate([prompt], GREEDY) == one.generate([prompt], GREEDY)
        assert two.spec_stats.accepted_tokens > 0
    finally:
        two.close()


def test_killed_follower_stops_the_engine_with_a_clear_error(loaded_model: LoadedModel,
                                                             prompts: list[list[int]]) -> None:
    engine = LLMEngine(EngineConfig(**ENGINE, tensor_parallel_size=2), loaded_model)
    assert engine.tp is not None
    follower = engine.tp.followers[0]

    async def scenario() -> None:
        runner = AsyncEngine(engine)
        try:
            tokens = [o async for o in runner.generate(GenerationRequest(
                "before", prompts[0], GREEDY))]
            assert tokens[-1].finished
            os.kill(follower.pid, signal.SIGKILL)
            follower.wait(10)
            began = time.monotonic()
            with pytest.raises(EngineDeadError, match=r"tensor-parallel group broken: .*"
                                                      r"rank 1 pid \d+: exit code -9"):
                async for _ in runner.generate(GenerationRequest("after", prompts[0], GREEDY)):
                    pass
            assert time.monotonic() - began < 10  # at once, not after the 60 s timeout
            with pytest.raises(EngineDeadError, match="tensor-parallel"):
                runner.check_health()
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(scenario())
    with pytest.raises(TensorParallelError, match="exit code -9"):
        engine.tp.all_reduce(engine.kv_cache)  # broken for good


def test_a_follower_that_cannot_start_is_named(loaded_model: LoadedModel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 runs the weights it was handed; rank 1 must load them from config.model, which
    here does not exist: the engine does not start, and says which rank failed."""
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) failed to start "
                                                  r"\(exit code 1"):
        LLMEngine(EngineConfig(**ENGINE, model=missing, tensor_parallel_size=2), loaded_model)


def test_a_hung_follower_fails_the_step_at_the_timeout(loaded_model: LoadedModel,
                                                       prompts: list[list[int]]) -> None:
    engine = LLMEngine(EngineConfig(**ENGINE, tensor_parallel_size=2,
                                    tensor_parallel_timeout_s=2.0), loaded_model)
    assert engine.tp is not None
    follower = engine.tp.followers[0]
    try:
        os.kill(follower.pid, signal.SIGSTOP)
        engine.add_request(GenerationRequest("r", prompts[0], GREEDY))
        began = time.monotonic()
        with pytest.raises(TensorParallelError, match="all_reduce failed: .*rank 1 pid"):
            engine.step()
        assert 2.0 <= time.monotonic() - began < 6
        assert follower.returncode == -signal.SIGKILL  # the broken group killed it
    finally:
        engine.close()


def test_a_follower_fails_an_all_reduce_rank_0_never_joins_at_the_timeout(
        loaded_model: LoadedModel) -> None:
    """The follower's side of the deadline (gloo): rank 0 sends a step but does not run it, so
    the follower's first all-reduce has no partner; it gives up at the timeout and exits."""
    engine = LLMEngine(EngineConfig(**ENGINE, tensor_parallel_size=2,
                                    tensor_parallel_timeout_s=2.0), loaded_model)
    assert engine.tp is not None
    follower = engine.tp.followers[0]
    try:
        began = time.monotonic()
        engine.tp.step([1, 2, 3], [0, 1, 2], [3], [3], [[0]], 0)
        assert follower.wait(10) == 1  # its collective failed (its error is in stderr)
        assert 2.0 <= time.monotonic() - began < 8
    finally:
        engine.close()


@pytest.mark.parametrize(("device", "waited"), [("cuda", datetime.timedelta(0)),
                                                ("cuda:1", datetime.timedelta(0)),
                                                ("cpu", datetime.timedelta(seconds=7))])
def test_an_all_reduce_waits_on_the_stream_on_cuda_on_the_host_on_a_cpu(
        device: str, waited: datetime.timedelta) -> None:
    """A timed wait on NCCL polls from the host, sleeping 1 ms a poll (>= 64 ms a step for 32
    layers): on CUDA the stream waits, no timeout given (``timedelta(0)``, torch's
    ``kNoTimeout``: what ``Work.wait()`` passes), and NCCL's watchdog keeps the deadline; on
    gloo the host waits, at most the timeout. The work is torch's own, recording its wait."""
    seen: list[datetime.timedelta] = []
    work = PythonCallbackWork(lambda timeout: seen.append(timeout) or True)
    wait_all_reduce(work, device, datetime.timedelta(seconds=7))
    assert seen == [waited]


@pytest.mark.parametrize(("settings", "problem"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ({"tensor_parallel_timeout_s": 0}, "tensor_parallel_timeout_s must be > 0, got 0"),
    ({"tensor_parallel_size": 2, "host_kv_cache_gb": 0.5},
     "tensor_parallel_size 2 does not support host_kv_cache_gb"),
    ({"tensor_parallel_size": 2, "speculative": SpeculativeConfig(method="self")},
     "tensor_parallel_size 2 does not support speculative method 'self'"),
])
def test_settings_it_cannot_serve_are_named(settings: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_more_ranks_than_kv_heads_is_refused(loaded_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 4 is more than the model's 3 "
                                         "KV heads"):
        Shard.of(loaded_model.config, 0, 4)
