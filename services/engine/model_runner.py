"""Turns a scheduled step into model inputs, runs the model, returns the logits it needs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tandem.services.engine.attention import build_step_metadata
from tandem.services.engine.attention.metadata import DecodeRows
from tandem.services.engine.cuda_graphs import DecodeGraphs
from tandem.services.engine.device import to_device
from tandem.services.engine.kv_cache import KVCache, kv_storage
from tandem.services.engine.model import LlamaModel
from tandem.services.engine.scheduler import ScheduledSequence
from tandem.services.engine.sequence import Sequence
from tandem.services.engine.tensor_parallel import TensorParallelGroup

# A step that computes at least this many prompt tokens runs on ``prefill_threads`` torch
# threads: its projections are matrix products long enough to split (a decode step's are
# matrix-vector products, bound by memory, where a second thread mostly waits).
PREFILL_THREADS_MIN_TOKENS = 32


@dataclass
class StepResult:
    logits: torch.Tensor  # [rows, vocab] float32
    sampled: list[Sequence]  # sequences whose step reached their last token
    # sampled[i] owns logits rows first_rows[i] .. first_rows[i] + len(spec_token_ids): one
    # for its next token, plus one per speculative draft token it verifies.
    first_rows: list[int]
    # Prompt logprobs: (sequence, its first logits row, the position that row predicts from,
    # number of rows); row k predicts prompt token position + k + 1.
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int,
                 device: str = "cpu", followers: TensorParallelGroup | None = None,
                 prefill_threads: int | None = None) -> None:
        """``followers``: the other ranks of a tensor-parallel model; they run each step too.
        ``prefill_threads``: this process's torch threads in a step that computes at least
        PREFILL_THREADS_MIN_TOKENS prompt tokens (None: as many as in every other step)."""
        self.model = model
        self.prefill_threads = prefill_threads
        self.followers = followers
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | None = None  # decode steps replayed as CUDA graphs
        # The torch backend reads decoding sequences' K/V from rows kept between steps, at
        # most as many bytes as the cache itself holds (attention/metadata.py).
        self.decode_rows: DecodeRows | None = None
        if model.attention.name == "torch":
            c = model.config
            self.decode_rows = DecodeRows(kv_cache, c.num_layers, model.num_kv_heads,
                                          c.head_dim, block_size, model.embed.dtype,
                                          max_bytes=kv_storage(kv_cache).nbytes)

    def execute(self, scheduled: list[ScheduledSequence]) -> StepResult:
        # Decoding sequences go first, grouped by query length (1, or 1 + draft tokens): the
        # torch backend batches each group. Prefill chunks follow.
        by_length: dict[int, list[ScheduledSequence]] = defaultdict(list)
        prefills: list[ScheduledSequence] = []
        for item in scheduled:
            if item.num_new_tokens == 1 or item.seq.spec_token_ids:
                by_length[item.num_new_tokens].append(item)
            else:
                prefills.append(item)
        ordered = [i for _, items in sorted(by_length.items()) for i in items] + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        first_rows: list[int] = []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []
        for item in ordered:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
            wanted_prompt = seq.prompt_logprob_positions
            first, last = max(start, wanted_prompt.start), min(end, wanted_prompt.stop)
            if first < last:  # this chunk's logits for the prompt's logprobs
                prompt_rows.append((seq, len(logits_rows), first, last - first))
                row = len(input_ids) - start
                logits_rows.extend(range(row + first, row + last))
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(seq.block_ids[:-(-end // self.block_size)])
            if end == seq.num_tokens + len(seq.spec_token_ids):
                # Logits for the last real token, and for each draft token after it.
                wanted = 1 + len(seq.spec_token_ids)
                first_rows.append(len(logits_rows))
                row = len(input_ids)
                logits_rows.extend(range(row - wanted, row))
                sampled.append(seq)

        if self.graphs is not None and not prefills and self.graphs.fits(query_lens):
            logits = self.graphs.run(input_ids, seq_lens, tables)  # one row per sequence
            if len(logits_rows) < len(ordered):  # a 1-token prefill chunk short of its end
                logits = logits[self._tensor(logits_rows)]
            return StepResult(logits=logits, sampled=sampled, first_rows=first_rows)
        num_decodes = len(ordered) - len(prefills)
        step = build_step_metadata(query_lens, seq_lens, tables, num_decodes, self.block_size,
                                   self.device, self.decode_rows,
                                   [item.seq.kv_key for item in ordered])
        try:
            plan = self.model.attention.prepare(step)
            if self.followers is not None:
                self.followers.step(input_ids, positions, query_lens, seq_lens, tables,
                                    num_decodes)
        except BaseException:
            self._drop_rows()
            raise
        prompt_tokens = sum(item.num_new_tokens for item in prefills)
        try:
            with self._threads(prompt_tokens):
                logits = self.model(self._tensor(input_ids), self._tensor(positions),
                                    self.kv_cache, plan, self._tensor(logits_rows))
        except BaseException as exc:
            self._drop_rows()
            if self.followers is None or not isinstance(exc, Exception):
                raise
            raise self.followers.broken(exc) from exc
        return StepResult(logits=logits, sampled=sampled, first_rows=first_rows,
                          prompt_rows=prompt_rows)

    @contextmanager
    def _threads(self, prompt_tokens: int) -> Iterator[None]:
        """torch's threads for a step computing ``prompt_tokens`` prompt tokens."""
        threads = torch.get_num_threads()
        wanted = (self.prefill_threads if self.prefill_threads is not None
                  and prompt_tokens >= PREFILL_THREADS_MIN_TOKENS else threads)
        if wanted == threads:
            yield
            return
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _drop_rows(self) -> None:
        """After a failed step: its decode rows may be half-written."""
        if self.decode_rows is not None:
            self.decode_rows.clear()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)
