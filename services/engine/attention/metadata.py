"""One step's attention inputs, flat, built once by the model runner and read by every layer.

Sequences appear in the order of their query rows: the decoding ones first (one query row, or
one plus its speculative draft tokens; ``num_decodes`` of them, by query length ascending),
then prefill chunks. Sequence ``s`` owns rows ``query_start[s]:query_start[s + 1]`` and
attends to its keys ``0 .. seq_lens[s] - 1`` (every token so far, this step's included),
held in cache blocks ``block_tables[s]``. Query row ``i`` of a sequence with ``q`` rows sits
at position ``seq_lens[s] - q + i`` and sees keys up to it: one rule for decoding,
verifying drafts, a prefill chunk over cached context and a fresh prefill.

The tensors live on the engine's device; the host lists are the same numbers, so a backend
plans its step (grouping, grid sizes) without a device sync.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from tandem.services.engine.attention.decode_rows import DecodeRows
from tandem.services.engine.device import to_device


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block id * block_size + offset of each new token
    query_start: torch.Tensor  # [S + 1] int32: cumulative query rows
    seq_lens: torch.Tensor  # [S] int32: keys each sequence attends to
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    block_size: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    num_decodes: int  # the leading sequences that decode (grouped by query length)
    # The runner's contiguous copies of its decoding sequences' K/V, and each sequence's key
    # there (torch backend; None: gather the blocks every step).
    decode_rows: DecodeRows | None = None
    seq_keys: list[Hashable] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


def build_step_metadata(query_lens: list[int], seq_lens: list[int],
                        block_tables: list[list[int]], num_decodes: int, block_size: int,
                        device: str | torch.device, decode_rows: DecodeRows | None = None,
                        seq_keys: list[Hashable] | None = None) -> StepMetadata:
    """The step's metadata from per-sequence host lists (tables cover each ``seq_lens``)."""
    starts = [0]
    slots: list[int] = []
    for q, n, table in zip(query_lens, seq_lens, block_tables, strict=True):
        starts.append(starts[-1] + q)
        slots.extend(table[pos // block_size] * block_size + pos % block_size
                     for pos in range(n - q, n))
    width = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return StepMetadata(slot_mapping=to_device(slots, torch.long, device),
                        query_start=to_device(starts, torch.int32, device),
                        seq_lens=to_device(seq_lens, torch.int32, device),
                        block_tables=to_device(padded, torch.int32, device).view(len(padded),
                                                                                 width),
                        block_size=block_size, query_lens_host=list(query_lens),
                        seq_lens_host=list(seq_lens), num_decodes=num_decodes,
                        decode_rows=decode_rows, seq_keys=seq_keys)

