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

from tandem.services.engine.attention import StepMetadata
from tandem.services.engine.kv_cache import KVCache
from tandem.services.engine.model import LlamaModel

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


# A graph's inputs: one entry per row, the block tables one row per row.
_INPUTS = (("input_ids", torch.long), ("positions", torch.long), ("slot_mapping", torch.long),
           ("seq_lens", torch.int32), ("block_tables", torch.int32))


@dataclass
class _Graph:
    """One batch size's static inputs, each its own device tensor (never a view at an offset
    into another: the kernels are compiled for 16-byte aligned pointers), and its twin on the
    host (pinned on a GPU) where a step writes them before one copy each."""

    size: int
    device: dict[str, torch.Tensor]  # _INPUTS by name; padding rows: slot -1, seq_len 1
    host: dict[str, torch.Tensor]
    # What each block-table row holds on the host: a sequence's table grows by a block every
    # block_size steps, so a step rewrites only what changed, not every row's every entry.
    rows: list[list[int]]
    copied: torch.cuda.Event | None = None  # the last host-to-device copies (pinned memory)
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
        if graph.copied is not None:  # the last step's copies have read the host buffers
            graph.copied.synchronize()
        bs = self.block_size
        host = {name: t.numpy() for name, t in graph.host.items()}
        positions = [length - 1 for length in seq_lens]
        host["input_ids"][:n], host["positions"][:n] = input_ids, positions
        host["slot_mapping"][:n] = [table[p // bs] * bs + p % bs
                                    for table, p in zip(block_tables, positions, strict=True)]
        host["seq_lens"][:n] = seq_lens
        # Padding rows keep what _buffers gave them: token 0 at position 0, no K/V stored
        # (slot -1), one key of block 0 read; their logits are dropped.
        tables = host["block_tables"]
        for row, table in enumerate(block_tables):
            # Entries past a sequence's length are never read, so stale ones may stay.
            held = graph.rows[row]
            kept = len(held) if len(table) >= len(held) and table[:len(held)] == held else 0
            if kept < len(table):
                tables[row, kept:len(table)] = table[kept:]
                graph.rows[row] = list(table)
        for name, _ in _INPUTS:
            graph.device[name].copy_(graph.host[name], non_blocking=True)
        if graph.copied is not None:
            graph.copied.record()
        if graph.replay is None:
            graph.replay = self._capture(self._forward(graph))
        self.replays += 1
        return graph.replay()[:n]

    def self_check(self, block_ids: list[int], steps: int = 3) -> str | None:
        """Why the graphs cannot be trusted here (None: they can): ``steps`` decode steps of
        one sequence in blocks ``block_ids`` (free blocks: their contents are overwritten),
        each through the smallest graph and then eagerly on the same inputs, must give the
        same logits (to 1% of their largest magnitude: a graph replaying stale inputs or
        storing K/V in the wrong place is off by far more). Each step reads the K/V the one
        before stored. Run before serving; it leaves the replay count at 0."""
        assert steps <= len(block_ids) * self.block_size
        size = min(self.graphs)
        for step in range(steps):
            seq_len = step + 1
            table = list(block_ids[:-(-seq_len // self.block_size)])
            graphed = self.run([7 * step + 1], [seq_len], [table])[0].float()
            eager = self._forward(self.graphs[size])()[0].float()  # the same inputs, eagerly
            worst = (graphed - eager).abs().max().item()
            if not worst <= 0.01 * eager.abs().max().item():  # NaN fails too
                return (f"decode step {step + 1} through the CUDA graph differs from the same "
                        f"step run eagerly (largest logit difference {worst:.3g})")
        self.replays = 0
        return None

    def _buffers(self, size: int) -> _Graph:
        on_gpu = torch.device(self.device).type == "cuda"
        host = {name: torch.zeros((size, self.max_blocks) if name == "block_tables" else size,
                                  dtype=dtype, pin_memory=on_gpu) for name, dtype in _INPUTS}
        host["slot_mapping"] -= 1
        host["seq_lens"] += 1
        device = {name: t.to(self.device, copy=True) for name, t in host.items()}
        return _Graph(size, device, host, [[] for _ in range(size)],
                      torch.cuda.Event() if on_gpu else None)

    def _forward(self, graph: _Graph) -> Callable[[], torch.Tensor]:
        """The step on ``graph``'s buffers; its plan is made for the longest context, so one
        graph serves every context length."""
        size = graph.size
        inputs = graph.device
        step = StepMetadata(
            slot_mapping=inputs["slot_mapping"],
            query_start=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            seq_lens=inputs["seq_lens"], block_tables=inputs["block_tables"],
            block_size=self.block_size, query_lens_host=[1] * size,
            seq_lens_host=[self.max_model_len] * size, num_decodes=size)
        plan = self.model.attention.prepare(step)
        rows = torch.arange(size, device=self.device)

        def forward() -> torch.Tensor:
            return self.model(inputs["input_ids"], inputs["positions"], self.kv_cache, plan,
                              rows)

        return forward
