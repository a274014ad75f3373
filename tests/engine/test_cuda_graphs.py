"""Decode CUDA graphs' bookkeeping, without a GPU: the batch ladder, padding rows that store
nothing, static buffers reused across steps and batch sizes. The capture is injected: here it
runs the step eagerly on the graph's buffers (the triton kernels under the interpreter), so
everything but the recording itself is what runs on a GPU."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels' module is imported
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.services.engine.config import EngineConfig  # noqa: E402
from tandem.services.engine.cuda_graphs import DecodeGraphs, batch_ladder, eager_capture  # noqa: E402
from tandem.services.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.services.protocol.request import SamplingParams  # noqa: E402

GRAPH_CONTEXT = 256  # the graphs' longest context (keeps the split count at 1 here)


def test_batch_ladder() -> None:
    assert batch_ladder(1) == [1]
    assert batch_ladder(5) == [1, 2, 4, 5]
    assert batch_ladder(32) == [1, 2, 4, 8, 16, 32]
    assert batch_ladder(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.fixture(scope="module")
def short_model(loaded_model):  # type: ignore[no-untyped-def]
    """The model's first 2 layers: the bookkeeping, not the depth."""
    return dataclasses.replace(loaded_model, config=dataclasses.replace(loaded_model.config,
                                                                        num_layers=2))


def _engine(short_model, graphs: bool, kv_cache_dtype: str = "auto") -> LLMEngine:  # type: ignore[no-untyped-def]
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, attention_backend="triton",
                                    max_num_seqs=8, kv_cache_dtype=kv_cache_dtype), short_model)
    if graphs:
        engine.runner.graphs = DecodeGraphs(engine.runner.model, engine.kv_cache,
                                            engine.config.block_size, 8, GRAPH_CONTEXT, "cpu",
                                            capture=eager_capture)
    return engine


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graphs_give_the_eager_tokens_as_the_batch_shrinks(short_model, prompts,  # type: ignore[no-untyped-def]
                                                           kv_cache_dtype: str) -> None:
    # 3 sequences (padded to 4), then 2, then 1 as they finish: three graphs, shared buffers.
    # An int8 cache: the same views every step, quantized by the store kernel (no host sync).
    batch = [prompts[0], prompts[1][:20], prompts[2][:9]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 6, 3)]
    outputs = {}
    for graphs in (False, True):
        engine = _engine(short_model, graphs, kv_cache_dtype)
        outputs[graphs] = engine.generate(batch, params)
        outputs[graphs] += engine.generate([prompts[1][:12]], params[0])  # buffers reused
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        if graphs:
            assert engine.runner.graphs is not None and engine.runner.graphs.replays >= 8
    assert outputs[True] == outputs[False]


def test_padding_rows_store_nothing(short_model) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(short_model, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    cache = engine.kv_cache
    cache.normal_()
    before = cache.clone()
    # 3 sequences at positions 4, 20 and 40 of blocks 5, 6+7, 8+9+10: padded to 4 rows.
    logits = graphs.run([11, 12, 13], [5, 21, 41], [[5], [6, 7], [8, 9, 10]])
    assert logits.shape == (3, short_model.config.vocab_size)
    changed = (cache != before).flatten(2).any(-1)  # [blocks, layers]: which were written
    bs = engine.config.block_size
    written = {(5, 4 % bs), (7, 20 % bs), (10, 40 % bs)}
    assert {b for b in range(cache.shape[0]) if changed[b].any()} == {b for b, _ in written}
    for block, offset in written:
        rows = (cache[block] != before[block]).flatten(3).any(-1)  # [layers, 2, block_size]
        assert rows.any(0).any(0).nonzero().flatten().tolist() == [offset]


def test_block_tables_follow_every_change_between_steps(short_model) -> None:  # type: ignore[no-untyped-def]
    # A step rewrites only the table entries that changed since that graph's last step: a
    # table that grew, a row taken by another sequence (sharing a prefix block or not), a
    # table trimmed and regrown with other blocks. The device tables must equal the step's.
    engine = _engine(short_model, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    bs = engine.config.block_size
    steps = [[[1], [2, 3], [4, 5, 6]],
             [[1, 7], [2, 3], [4, 5, 6]],  # the first grew by a block
             [[1, 7], [2, 8, 9], [4, 5, 6]],  # the second: same first block, others changed
             [[10], [2, 8, 9, 11], [12, 13]],  # a new sequence in row 0, row 2 replaced
             [[10, 14], [2, 8], [12, 13]]]  # row 1 trimmed
    for tables in steps:
        seq_lens = [len(t) * bs for t in tables]
        graphs.run([1, 2, 3], seq_lens, tables)
        inputs = graphs.graphs[4].device
        device = inputs["block_tables"].cpu()
        for row, table in enumerate(tables):
            assert device[row, :len(table)].tolist() == table
        assert inputs["seq_lens"].tolist() == seq_lens + [1]
        assert inputs["slot_mapping"].tolist() == [t[-1] * bs + bs - 1 for t in tables] + [-1]
    # Every input its own tensor: no view at an offset into another (alignment).
    assert all(t.storage_offset() == 0 for t in inputs.values())


def test_self_check_passes_the_graphs_and_catches_one_that_replays_stale_work(short_model  # type: ignore[no-untyped-def]
                                                                              ) -> None:
    engine = _engine(short_model, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    assert graphs.self_check([3]) is None
    assert graphs.replays == 0

    def frozen(run):  # type: ignore[no-untyped-def]
        """A 'graph' whose replays do nothing: the output of the step it was captured at."""
        out = run()
        return lambda: out

    broken = DecodeGraphs(engine.runner.model, engine.kv_cache, engine.config.block_size, 8,
                          GRAPH_CONTEXT, "cpu", capture=frozen)
    problem = broken.self_check([3])
    assert problem is not None and problem.startswith("decode step 2 through the CUDA graph")
