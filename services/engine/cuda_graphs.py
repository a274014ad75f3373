"""CUDA graphs for decode steps: captured once per batch size of a ladder, replayed per step.

A step in which every sequence decodes one token (no prefill chunk, no draft rows) and that
has at most the ladder's largest batch runs the graph of the smallest ladder size that holds
it. Its inputs are copied into that graph's static buffers; the spare rows are padding: they
store no K/V (slot -1), attend to one key, and their logits are dropped. Every other step runs
eagerly. Graphs need the triton attention backend (its launch is fixed by the metadata's
shapes; the torch backend plans in Python per step) and a CUDA device.

Capture is injectable (``capture``): on a CPU the tests run the same bookkeeping (ladder,
padding, buffer reuse across steps) with a capture that just runs the step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.attention import StepMetadata
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel

# Batch sizes with a graph: small ones one by one, then every 16 (vLLM's ladder is similar).
SMALL_SIZES = (1, 2, 4, 8)
STRIDE = 16

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def batch_ladder(max_batch: int) -> list[int]:
    """The captured batch sizes for steps of up to ``max_batch`` sequences."""
    sizes = [s for s in SMALL_SIZES if s < max_batch]
    sizes += list(range(STRIDE, max_batch, STRIDE))
    return sizes + [max_batch]


def cuda_graph_capture(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``run`` recorded as a CUDA graph; the returned function replays it and returns the
    graph's (static) output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture: Triton compiles, allocators settle
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def eager_capture(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The stand-in for ``cuda_graph_capture`` on a CPU: the step itself, run on the graph's
    buffers (tests and ``gpu_check --tiny``)."""
    return run


@dataclass
class _Graph:
    size: int
    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    slot_mapping: torch.Tensor  # [size] int64, -1 on padding rows
    seq_lens: torch.Tensor  # [size] int32, 1 on padding rows
    block_tables: torch.Tensor  # [size, max_blocks] int32
    replay: Callable[[], torch.Tensor] | None = None


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int,
                 max_batch: int, max_model_len: int, device: str,
                 capture: Capture = cuda_graph_capture) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self._capture = capture
        self.graphs = {size: self._buffers(size) for size in batch_ladder(max_batch)}
        self.replays = 0  # steps served by a graph (a metric for tests and logs)

    @property
    def max_batch(self) -> int:
        return max(self.graphs)

    def capture_all(self) -> None:
        """Record every size's graph (at start-up: each costs a few warm-up steps)."""
        for graph in sorted(self.graphs.values(), key=lambda g: -g.size):
            graph.replay = self._capture(self._forward(graph))

    def fits(self, query_lens: list[int]) -> bool:
        return 0 < len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens)

    def run(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]]
            ) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n sequences (``fits``): sequence i feeds
        ``input_ids[i]`` at position ``seq_lens[i] - 1`` into its ``block_tables[i]``."""
        n = len(input_ids)
        graph = self.graphs[min(size for size in self.graphs if size >= n)]
        pad = graph.size - n
        bs = self.block_size
        positions = [length - 1 for length in seq_lens]
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions,
                                                                   strict=True)]
        # Only the columns in use: entries past a sequence's length are never read, and a
        # padding row reads its first entry alone (any block id is a valid read).
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        for buffer, values in ((graph.input_ids, input_ids + [0] * pad),
                               (graph.positions, positions + [0] * pad),
                               (graph.slot_mapping, slots + [-1] * pad),
                               (graph.seq_lens, seq_lens + [1] * pad),
                               (graph.block_tables[:n, :width], tables)):
            buffer.copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)
        if graph.replay is None:
            graph.replay = self._capture(self._forward(graph))
        self.replays += 1
        return graph.replay()[:n]

    def _buffers(self, size: int) -> _Graph:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        return _Graph(size, zeros(size, dtype=torch.long), zeros(size, dtype=torch.long),
                      zeros(size, dtype=torch.long) - 1, zeros(size, dtype=torch.int32) + 1,
                      zeros(size, self.max_blocks, dtype=torch.int32))

    def _forward(self, graph: _Graph) -> Callable[[], torch.Tensor]:
        """The step on ``graph``'s buffers; its plan is made for the longest context, so one
        graph serves every context length."""
        size = graph.size
        step = StepMetadata(
            slot_mapping=graph.slot_mapping,
            query_start=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            seq_lens=graph.seq_lens, block_tables=graph.block_tables,
            block_size=self.block_size, query_lens_host=[1] * size,
            seq_lens_host=[self.max_model_len] * size, num_decodes=size)
        plan = self.model.attention.prepare(step)
        rows = torch.arange(size, device=self.device)

        def forward() -> torch.Tensor:
            return self.model(graph.input_ids, graph.positions, self.kv_cache, plan, rows)

        return forward
