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

Decoding sequences' keys and values kept contiguous between steps, for the torch backend.

Gathering a decoding sequence's blocks into one tensor every step copies its whole context in
every layer (at batch 32 and ~250-token contexts, 180 MB a step: as much time as the attention
that reads it). ``DecodeRows`` keeps one row per decoding sequence instead, ``[num_layers, 2,
rows, capacity, Hkv, D]`` in the compute dtype: a sequence's context is copied from its blocks
once, when it starts decoding, and each step after that adds only its new token's k/v. SDPA
reads the rows in place. The values are the blocks' own (an int8 cache's dequantized exactly as
a gather would), so the attention's output is the same, bit for bit.

A row belongs to a sequence *incarnation* (``key``: the sequence and its preemption count, so a
recomputed context is never read from an older copy). Rows stay dense: a step's decoding
sequences occupy rows ``0 .. n-1`` (rows of sequences that left are filled by moving the last
ones down), and a sequence absent from a step's decode batch gives its row up. Memory is
bounded by ``max_bytes``; a step that would need more falls back to gathering.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from tandem.services.engine.device import to_device
from tandem.services.engine.kv_cache import KVCache, QuantizedKV, dequantize_int8


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


# Rows grow by at least this many tokens at a time (fewer reallocations as contexts grow).
_GROWTH_TOKENS = 256


@dataclass(frozen=True)
class RowPlan:
    """Where a step's decode batch of ``n`` sequences (one query row each) reads its keys."""

    rows: torch.Tensor  # [n] the row of batch sequence i
    order: torch.Tensor  # [n] the batch sequence in row r (the inverse of rows)
    positions: torch.Tensor  # [n] where each sequence's new token goes in its row


class DecodeRows:
    def __init__(self, kv_cache: KVCache, num_layers: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, max_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._dims = (num_kv_heads, head_dim)
        self._layers = num_layers
        self._dtype = dtype
        self.data = torch.empty((num_layers, 2, 0, 0, num_kv_heads, head_dim), dtype=dtype,
                                device=self._device)
        self._keys: list[Hashable | None] = []  # row -> owner
        self._filled: list[int] = []  # row -> positions that hold its owner's k/v

    @property
    def _device(self) -> torch.device:
        storage = self.kv_cache.data if isinstance(self.kv_cache, QuantizedKV) else self.kv_cache
        return storage.device

    @property
    def owners(self) -> list[Hashable | None]:
        """Each row's sequence key (None: free), in row order."""
        return list(self._keys)

    @property
    def capacity(self) -> int:
        return int(self.data.shape[3])

    def arrange(self, keys: Sequence[Hashable], seq_lens: Sequence[int],
                tables: torch.Tensor) -> RowPlan | None:
        """Rows for a decode batch (``keys[i]`` with ``seq_lens[i]`` keys, this step's token
        the last, in blocks ``tables[i]``): rows of sequences not in it are given up, the rest
        moved into ``0 .. n-1``, new and lagging ones filled from their blocks up to their new
        token. None (every row given up) when the batch does not fit ``max_bytes``: gather."""
        n = len(keys)
        unit = self.block_size * max(1, _GROWTH_TOKENS // self.block_size)
        needed = -(-max(seq_lens) // unit) * unit
        row_bytes = 2 * self._layers * self._dims[0] * self._dims[1] * self.data.element_size()
        if n * max(needed, self.capacity) * row_bytes > self.max_bytes:
            self.clear()
            return None
        self._give_up_absent(set(keys), n)
        self._reserve(n, needed)
        row_of = {key: row for row, key in enumerate(self._keys) if key is not None}
        free = iter(row for row, key in enumerate(self._keys) if key is None)
        rows: list[int] = []
        for i, (key, length) in enumerate(zip(keys, seq_lens, strict=True)):
            row = row_of.get(key)
            if row is None:
                row = next(free)
                self._keys[row], self._filled[row] = key, 0
            if self._filled[row] < length - 1:
                self._fill(row, tables[i], self._filled[row], length - 1)
            self._filled[row] = length
            rows.append(row)
        device = self._device
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        order = torch.empty_like(rows_t)
        order[rows_t] = torch.arange(n, device=device)
        positions = torch.tensor([length - 1 for length in seq_lens], dtype=torch.long,
                                 device=device)
        return RowPlan(rows_t, order, positions)

    def clear(self) -> None:
        self._keys, self._filled = [], []
        self.data = self.data.new_empty((self._layers, 2, 0, 0, *self._dims))

    def _give_up_absent(self, present: set[Hashable], n: int) -> None:
        """Free the rows of sequences not in the batch; move rows at ``n`` or beyond into the
        freed ones below ``n`` (their valid positions only), so the batch's rows are dense."""
        for row, key in enumerate(self._keys):
            if key not in present:
                self._keys[row], self._filled[row] = None, 0
        holes = [row for row in range(min(n, len(self._keys))) if self._keys[row] is None]
        for src in range(n, len(self._keys)):
            if self._keys[src] is None:
                continue
            dst = holes.pop(0)
            length = self._filled[src]
            self.data[:, :, dst, :length] = self.data[:, :, src, :length]
            self._keys[dst], self._filled[dst] = self._keys[src], length
            self._keys[src], self._filled[src] = None, 0
        del self._keys[n:], self._filled[n:]

    def _reserve(self, rows: int, capacity: int) -> None:
        """At least ``rows`` rows of at least ``capacity`` positions, contents kept."""
        have_rows, have_cap = self.data.shape[2], self.capacity
        if rows <= have_rows and capacity <= have_cap:
            self._keys += [None] * (rows - len(self._keys))
            self._filled += [0] * (rows - len(self._filled))
            return
        # Zeros, not empty memory: SDPA multiplies the masked positions past a row's length
        # by a weight of 0, and 0 x NaN (a garbage bit pattern) is NaN. Every position holds
        # zeros or some owner's k/v from then on, so masked ones are always finite.
        grown = self.data.new_zeros((self._layers, 2, max(rows, have_rows),
                                     max(capacity, have_cap), *self._dims))
        for row, length in enumerate(self._filled):
            if length:
                grown[:, :, row, :length] = self.data[:, :, row, :length]
        self.data = grown
        self._keys += [None] * (rows - len(self._keys))
        self._filled += [0] * (rows - len(self._filled))

    def _fill(self, row: int, table: torch.Tensor, start: int, end: int) -> None:
        """Positions ``[start, end)`` of ``row`` from the blocks that hold them, every layer."""
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        blocks = table[first:last].long()
        if isinstance(self.kv_cache, QuantizedKV):
            values = dequantize_int8(self.kv_cache.values.index_select(0, blocks),
                                     self.kv_cache.scales.index_select(0, blocks), self._dtype)
        else:
            values = self.kv_cache.index_select(0, blocks)
        # [blocks, layers, 2, bs, H, D] -> [layers, 2, blocks * bs, H, D]
        values = values.permute(1, 2, 0, 3, 4, 5).reshape(self._layers, 2, -1, *self._dims)
        offset = first * bs
        self.data[:, :, row, start:end] = values[:, :, start - offset:end - offset]
