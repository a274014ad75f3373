"""Turns a scheduled step into model inputs, runs the model, returns the logits it needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention import AttentionMetadata, PrefillSpan
from services.engine.model import LlamaModel
from services.engine.scheduler import ScheduledSequence
from services.engine.sequence import Sequence


@dataclass
class StepResult:
    logits: torch.Tensor  # [len(sampled), vocab] float32
    sampled: list[Sequence]  # sequences whose step reached their last token, in logits order


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    def execute(self, scheduled: list[ScheduledSequence]) -> StepResult:
        # Single-token queries go first: the attention backend batches them together.
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        bs = self.block_size
        for item in ordered:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            for pos in range(start, end):
                slot_blocks.append(seq.block_ids[pos // bs])
                slot_offsets.append(pos % bs)
            if n == 1:
                decode_tables.append(seq.block_ids[:-(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(self._prefill_span(seq, row, start, end))
            if end == seq.num_tokens:
                logits_rows.append(row + n - 1)
                sampled.append(seq)

        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=self._tensor(slot_offsets),
            num_decodes=len(decode_tables),
            decode_block_tables=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t))
                                                     for t in decode_tables])
            lens = self._tensor(decode_lens)
            key_pos = torch.arange(width * bs, device=self.device)
            meta.decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
        logits = self.model(self._tensor(input_ids), self._tensor(positions), self.kv_cache,
                            meta, self._tensor(logits_rows))
        return StepResult(logits=logits, sampled=sampled)

    def _prefill_span(self, seq: Sequence, row: int, start: int, end: int) -> PrefillSpan:
        n = end - start
        if start == 0:
            return PrefillSpan(row, row + n, end, self._tensor([]), mask=None)
        block_ids = self._tensor(seq.block_ids[:-(-end // self.block_size)])
        key_pos = torch.arange(end, device=self.device)
        query_pos = torch.arange(start, end, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        return PrefillSpan(row, row + n, end, block_ids, mask)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
