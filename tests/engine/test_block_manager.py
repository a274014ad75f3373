"""Block accounting, prefix-cache hits, LRU eviction and KV events, without a model."""

from __future__ import annotations

from tandem.services.engine.block_manager import BlockManager
from tandem.services.engine.sequence import Sequence
from tandem.services.protocol.kv_events import BlockRemoved, BlockStored
from tandem.services.protocol.request import SamplingParams

BS = 4


def make_seq(tokens: list[int], rid: str = "r", salt: str | None = None) -> Sequence:
    keys = ("m", salt) if salt else ("m",)
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), keys)


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    cached = bm.find_cached_prefix(seq)
    assert bm.can_admit(seq, cached, seq.num_tokens - len(cached) * BS)
    bm.admit(seq, cached)
    seq.num_computed_tokens = seq.num_cached_tokens  # as the scheduler does
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_allocate_and_free_account_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    run_prefill(bm, seq)
    assert len(seq.block_ids) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate(seq, 100)  # out of blocks: nothing changes
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(list(range(10)), "a")
    run_prefill(bm, first)
    events = bm.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert len(events[0].block_hashes) == 2  # type: ignore[attr-defined]
    bm.free(first)

    second = make_seq(list(range(10)) + [99, 98], "b")
    run_prefill(bm, second)
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first_blocks(bm, first)
    assert bm.stats.hits == 8 and bm.stats.queries == 22


def first_blocks(bm: BlockManager, seq: Sequence) -> list[int]:
    return [bm.cached_blocks[h] for h in seq.block_hashes[:2]]


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    seq = make_seq(list(range(8)))
    run_prefill(bm, seq)
    bm.free(seq)
    again = make_seq(list(range(8)), "again")
    assert len(bm.find_cached_prefix(again)) == 1  # not 2: the last token needs logits


def test_cache_salt_separates_tenants():
    bm = BlockManager(num_blocks=16, block_size=BS)
    run_prefill(bm, make_seq(list(range(9)), "a", salt="tenant-a"))
    assert bm.find_cached_prefix(make_seq(list(range(9)), "b", salt="tenant-b")) == []
    assert len(bm.find_cached_prefix(make_seq(list(range(9)), "c", salt="tenant-a"))) == 2


def test_lru_eviction_removes_suffix_first_and_queues_events():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = make_seq(list(range(12)) + [7], "old")  # 3 full blocks + 1 partial
    run_prefill(bm, old)
    prefix_hashes = list(old.block_hashes)
    bm.free(old)
    # A new sequence needs 2 blocks: the free queue hands out the never-cached partial block
    # and then the old chain's tail, so its first two blocks stay hittable.
    new = make_seq([50, 51, 52, 53, 54, 55], "new")
    run_prefill(bm, new)
    removed = [e for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [(prefix_hashes[2],)]
    probe = make_seq(list(range(12)) + [7], "probe")
    assert len(bm.find_cached_prefix(probe)) == 2


def test_duplicate_content_is_cached_once():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a, b = make_seq(list(range(8)) + [1], "a"), make_seq(list(range(8)) + [2], "b")
    for seq in (a, b):  # both admitted before either is cached: no hit for b
        cached = bm.find_cached_prefix(seq)
        bm.admit(seq, cached)
        bm.allocate(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    assert len(bm.cached_blocks) == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_events_are_queued_in_order_until_taken():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = make_seq(list(range(12)) + [7], "old")
    run_prefill(bm, old)
    bm.free(old)
    new = make_seq([50, 51, 52, 53, 54, 55], "new")
    run_prefill(bm, new)  # evicts old's third block, then caches new's first block
    events = bm.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert events[0].block_hashes == tuple(old.block_hashes)  # type: ignore[union-attr]
    assert events[1].block_hashes == (old.block_hashes[2],)  # type: ignore[union-attr]
    assert events[2].block_hashes == (new.block_hashes[0],)  # type: ignore[union-attr]
    assert bm.take_events() == []  # taking clears the queue
