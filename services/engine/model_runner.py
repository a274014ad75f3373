"""Turns a scheduled step into model inputs, runs the model, returns the logits it needs."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from services.engine.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from services.engine.model import LlamaModel
from services.engine.scheduler import ScheduledSequence
from services.engine.sequence import Sequence


@dataclass
class StepResult:
    logits: torch.Tensor  # [rows, vocab] float32
    sampled: list[Sequence]  # sequences whose step reached their last token
    # sampled[i] owns logits rows first_rows[i] .. first_rows[i] + len(spec_token_ids): one
    # for its next token, plus one per speculative draft token it verifies.
    first_rows: list[int]


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self._heads_per_kv_group = model.config.num_heads // model.config.num_kv_heads

    def execute(self, scheduled: list[ScheduledSequence]) -> StepResult:
        # Decoding sequences go first, grouped by query length (1, or 1 + draft tokens): the
        # attention backend batches each group. Prefill chunks follow, one span each.
        by_length: dict[int, list[ScheduledSequence]] = defaultdict(list)
        prefills: list[ScheduledSequence] = []
        for item in scheduled:
            if item.num_new_tokens == 1 or item.seq.spec_token_ids:
                by_length[item.num_new_tokens].append(item)
            else:
                prefills.append(item)

        self._input_ids: list[int] = []
        self._positions: list[int] = []
        self._slot_blocks: list[int] = []
        self._slot_offsets: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        first_rows: list[int] = []
        decodes: list[DecodeBatch] = []
        spans: list[PrefillSpan] = []
        for length, items in sorted(by_length.items()):
            decodes.append(self._decode_batch(items, length))
        for item in prefills:
            spans.append(self._prefill_span(item))
        row = 0
        for item in [i for _, items in sorted(by_length.items()) for i in items] + prefills:
            seq, n = item.seq, item.num_new_tokens
            if seq.num_computed_tokens + n == seq.num_tokens + len(seq.spec_token_ids):
                # Logits for the last real token, and for each draft token after it.
                wanted = 1 + len(seq.spec_token_ids)
                first_rows.append(len(logits_rows))
                logits_rows.extend(range(row + n - wanted, row + n))
                sampled.append(seq)
            row += n

        meta = AttentionMetadata(slot_blocks=self._tensor(self._slot_blocks),
                                 slot_offsets=self._tensor(self._slot_offsets),
                                 decodes=decodes, prefills=spans)
        logits = self.model(self._tensor(self._input_ids), self._tensor(self._positions),
                            self.kv_cache, meta, self._tensor(logits_rows))
        return StepResult(logits=logits, sampled=sampled, first_rows=first_rows)

    def _add_tokens(self, seq: Sequence, start: int, end: int) -> None:
        tokens = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
        self._input_ids.extend(tokens[start:end])
        self._positions.extend(range(start, end))
        bs = self.block_size
        for pos in range(start, end):
            self._slot_blocks.append(seq.block_ids[pos // bs])
            self._slot_offsets.append(pos % bs)

    def _decode_batch(self, items: list[ScheduledSequence], length: int) -> DecodeBatch:
        start = len(self._input_ids)
        tables, first_positions = [], []
        for item in items:
            seq = item.seq
            begin = seq.num_computed_tokens
            self._add_tokens(seq, begin, begin + length)
            tables.append(seq.block_ids[:-(-(begin + length) // self.block_size)])
            first_positions.append(begin)
        width = max(len(t) for t in tables)
        key_pos = torch.arange(width * self.block_size, device=self.device)
        # Query row i of a sequence sits at position first + i and sees keys up to it.
        query_pos = (self._tensor(first_positions)[:, None]
                     + torch.arange(length, device=self.device)[None, :])  # [n, length]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [n, length, keys]
        if length > 1:
            mask = mask[:, None].expand(-1, self._heads_per_kv_group, -1, -1)
        mask = mask.reshape(len(items), 1, -1, key_pos.numel())
        return DecodeBatch(start, len(items), length,
                           self._tensor([t + [0] * (width - len(t)) for t in tables]), mask)

    def _prefill_span(self, item: ScheduledSequence) -> PrefillSpan:
        seq, n = item.seq, item.num_new_tokens
        start, row = seq.num_computed_tokens, len(self._input_ids)
        end = start + n
        self._add_tokens(seq, start, end)
        if start == 0:
            return PrefillSpan(row, row + n, end, self._tensor([]), mask=None)
        block_ids = self._tensor(seq.block_ids[:-(-end // self.block_size)])
        key_pos = torch.arange(end, device=self.device)
        query_pos = torch.arange(start, end, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        return PrefillSpan(row, row + n, end, block_ids, mask)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
