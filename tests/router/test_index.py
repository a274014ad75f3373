"""The prefix index and the in-flight ledger, driven by explicit clocks."""

from __future__ import annotations

from tandem.router.index import PrefixIndex
from tandem.router.router import InFlight
from tandem.services.protocol.block_hash import hash_token_blocks
from tandem.services.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .cluster import tokens

H = hash_token_blocks(tokens(0, 16 * 10), 16, ("m",))


def stored(hashes: list[bytes], block_size: int = 16) -> BlockStored:
    return BlockStored(tuple(hashes), None, block_size)


def test_prefix_length_counts_leading_blocks_only() -> None:
    index = PrefixIndex(16)
    index.apply("a", stored(H[:6]))
    index.apply("b", stored(H[:2] + H[3:10]))  # a hole at block 2
    index.apply("c", stored(H[5:]))  # no first block
    assert index.prefix_lengths(H, ["a", "b", "c", "d"], now=0.0) == {
        "a": 6, "b": 2, "c": 0, "d": 0,
    }
    assert index.prefix_lengths([], ["a"], now=0.0) == {"a": 0}
    assert index.prefix_lengths(H[:3], ["a"], now=0.0) == {"a": 3}


def test_removed_and_cleared_events() -> None:
    index = PrefixIndex(16)
    index.apply("a", stored(H))
    index.apply("b", stored(H))
    index.apply("a", BlockRemoved(tuple(H[4:5])))
    assert index.prefix_lengths(H, ["a", "b"], 0.0) == {"a": 4, "b": 10}
    index.apply("b", AllBlocksCleared())
    assert index.prefix_lengths(H, ["a", "b"], 0.0) == {"a": 4, "b": 0}
    assert index.workers() == {"a"}
    index.remove_worker("a")
    assert index.confirmed_blocks == 0


def test_events_with_another_block_size_are_ignored() -> None:
    index = PrefixIndex(16)
    index.apply("a", stored(H, block_size=32))
    assert index.confirmed_blocks == 0


def test_provisional_entries_expire_after_ttl() -> None:
    index = PrefixIndex(16, provisional_ttl_s=2.0)
    index.add_provisional("a", H[:5], now=10.0)
    assert index.prefix_lengths(H, ["a"], now=11.9) == {"a": 5}
    assert index.prefix_lengths(H, ["a"], now=12.0) == {"a": 0}
    # Provisional entries do not make the index "non-empty": only workers' events do.
    assert index.confirmed_blocks == 0


def test_refreshed_provisional_entry_survives_the_older_expiry() -> None:
    index = PrefixIndex(16, provisional_ttl_s=2.0)
    index.add_provisional("a", H[:5], now=10.0)
    index.add_provisional("a", H[:5], now=11.0)
    index.expire(now=12.5)
    assert index.prefix_lengths(H, ["a"], now=12.5) == {"a": 5}
    index.expire(now=13.0)
    assert index.prefix_lengths(H, ["a"], now=12.5) == {"a": 0}


def test_provisional_and_confirmed_combine() -> None:
    index = PrefixIndex(16)
    index.apply("a", stored(H[:3]))
    index.add_provisional("a", H[3:6], now=0.0)
    assert index.prefix_lengths(H, ["a"], now=1.0) == {"a": 6}
    assert index.prefix_lengths(H, ["a"], now=5.0) == {"a": 3}


def test_inflight_clears_on_heartbeat_release_and_age() -> None:
    ledger = InFlight(max_age_s=30.0)
    ledger.add("r1", "a", 10, now=1.0)
    ledger.add("r2", "a", 5, now=2.0)
    ledger.add("r2", "d", 7, now=2.0)
    assert (ledger.blocks("a"), ledger.count("a"), ledger.blocks("d")) == (15, 2, 7)
    ledger.reported("a", heartbeat_at=1.5)  # sampled after r1 was sent, before r2
    assert ledger.blocks("a") == 5
    ledger.release("r2")
    assert (ledger.blocks("a"), ledger.blocks("d")) == (0, 0)
    ledger.add("r3", "a", 3, now=3.0)
    ledger.expire(now=33.5)
    assert ledger.blocks("a") == 0
