"""Random paged KV layouts and a dense reference attention, for every attention backend's tests.

A ``Step`` is one engine step's attention inputs over a random cache: sequences with their
query rows and keys, blocks drawn in shuffled order (optionally a shared prefix), q a
non-contiguous view as after a fused qkv projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.services.engine.attention.metadata import StepMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYER = 1  # of NUM_LAYERS: a nonzero layer checks the layer stride
NUM_LAYERS = 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# Head layouts (num_heads, num_kv_heads, head_dim): GQA groups 1, 3 (the built-in model) and 4
# (Llama-3's 32/8 at head_dim 128, with fewer heads).
MHA = (4, 4, 64)
BUILTIN = (9, 3, 64)
LLAMA3 = (8, 2, 128)


@dataclass
class Step:
    q: torch.Tensor  # [T, num_heads, head_dim], a non-contiguous view
    kv_cache: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float

    def metadata(self) -> StepMetadata:
        """The step as the engine describes it (no new tokens are written: empty slots)."""
        query_lens = (self.query_start[1:] - self.query_start[:-1]).tolist()
        return StepMetadata(torch.empty(0, dtype=torch.long, device=self.q.device),
                            self.query_start, self.seq_lens, self.block_tables,
                            self.kv_cache.shape[3], query_lens, self.seq_lens.tolist(),
                            num_decodes=sum(1 for q in query_lens if q == 1))


def make_step(seqs: list[tuple[int, int]], heads: tuple[int, int, int], block_size: int,
              dtype: torch.dtype = torch.float32, shared_prefix_blocks: int = 0,
              seed: int = 0) -> Step:
    """A random cache and step: sequence s has ``seqs[s] = (query_len, seq_len)``, its blocks
    drawn in shuffled order; the first ``shared_prefix_blocks`` block ids are common to all."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks of noise that nobody may read
    ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 2, dtype=torch.int32)
    shared, used = ids[:shared_prefix_blocks], shared_prefix_blocks
    for s, n in enumerate(blocks_per_seq):
        assert n >= shared_prefix_blocks
        own = ids[used:used + n - shared_prefix_blocks]
        used += len(own)
        block_tables[s, :n] = torch.cat([shared, own]).int()

    num_tokens = sum(q_len for q_len, _ in seqs)
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    # q as the first columns of a fused qkv projection: row stride != num_heads * head_dim.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)  # slice on the device: a copy would make q contiguous
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not q.is_contiguous()
    query_start = torch.tensor([0] + [q_len for q_len, _ in seqs]).cumsum(0).int()
    return Step(q, kv_cache.to(DEVICE), query_start.to(DEVICE),
                torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32, device=DEVICE),
                block_tables.to(DEVICE), max(q for q, _ in seqs), max(n for _, n in seqs),
                head_dim ** -0.5)


def reference(step: Step) -> torch.Tensor:
    """Dense float64 attention: gather each sequence's keys, explicit causal mask."""
    q, cache = step.q.cpu().double(), step.kv_cache[:, LAYER].cpu().double()
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    bounds = step.query_start.tolist()
    for s, seq_len in enumerate(step.seq_lens.tolist()):
        start, end = bounds[s], bounds[s + 1]
        pos = torch.arange(seq_len)
        blocks = step.block_tables[s].cpu().long()[pos // block_size]
        keys = cache[blocks, 0, pos % block_size].repeat_interleave(group, dim=1)
        values = cache[blocks, 1, pos % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * step.scale
        q_pos = seq_len - (end - start) + torch.arange(end - start)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.cpu().double(), expected, atol=tol, rtol=tol)
