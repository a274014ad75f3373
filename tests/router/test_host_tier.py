"""The host-memory KV tier in events, the index and prefill scoring (issue 20)."""

from __future__ import annotations

import pytest

from tandem.router.index import PrefixIndex
from tandem.router.wire import decode_event, encode_event
from tandem.services.protocol.block_hash import hash_token_blocks
from tandem.services.protocol.kv_events import HOST, AllBlocksCleared, BlockRemoved, BlockStored

from .cluster import SETTINGS, tokens
from .test_policy import Setup

H = hash_token_blocks(tokens(0, 16 * 10), 16, ("m",))


def test_wire_carries_the_tier_and_reads_events_without_one() -> None:
    for event in (BlockStored(tuple(H[:2]), None, 16, HOST), BlockRemoved(tuple(H[:1]), HOST),
                  BlockStored(tuple(H[:2]), H[0], 16), BlockRemoved(tuple(H[:1]))):
        assert decode_event(encode_event("w", event, 3)).event == event
    # A device event is encoded as before the tier existed.
    assert b'"m"' not in encode_event("w", BlockStored(tuple(H[:1]), None, 16))
    old = b'{"v":1,"w":"w","k":"removed","h":["' + H[0].hex().encode() + b'"]}'
    assert decode_event(old).event == BlockRemoved((H[0],))
    with pytest.raises(ValueError, match="unknown KV medium 'disk'"):
        decode_event(old.replace(b'"k"', b'"m":"disk","k"'))


def test_index_prefix_runs_through_either_tier_and_counts_host_blocks() -> None:
    index = PrefixIndex(16)
    index.apply("a", BlockStored(tuple(H[:4]), None, 16))
    index.apply("a", BlockStored(tuple(H[2:7]), None, 16, HOST))  # 2, 3 in both tiers
    index.apply("b", BlockStored(tuple(H[:3]), None, 16, HOST))
    host: dict[str, int] = {}
    assert index.prefix_lengths(H, ["a", "b", "c"], 0.0, host) == {"a": 7, "b": 3, "c": 0}
    assert host == {"a": 3, "b": 3, "c": 0}  # a: 4, 5, 6 only in host memory
    index.apply("a", BlockRemoved((H[5],), HOST))
    index.apply("b", BlockRemoved((H[0],)))  # a device removal leaves the host tier alone
    host = {}
    assert index.prefix_lengths(H, ["a", "b"], 0.0, host) == {"a": 5, "b": 3}
    assert host == {"a": 1, "b": 3}
    assert index.blocks_of("b") == 0 and index.workers() == {"a"}  # device blocks only
    index.apply("b", AllBlocksCleared())
    assert index.prefix_lengths(H, ["a", "b"], 0.0) == {"a": 5, "b": 0}
    index.remove_worker("a")
    assert index.prefix_lengths(H, ["a"], 0.0) == {"a": 0}


def test_a_host_hit_scores_between_a_device_hit_and_a_miss() -> None:
    s = Setup()
    device, host = s.worker("device"), s.worker("host")
    s.worker("miss")
    s.worker("d0", "decode")
    prompt = tokens(1, 16 * 40)
    hashes = device.cache(prompt)
    host.forwarder.publish([BlockStored(tuple(hashes), None, SETTINGS.block_size, HOST)])
    router = s.router("prefix")
    router.sync()
    scores = router.route(prompt).prefill_scores
    assert scores["device"] < scores["host"] < scores["miss"]
    # A snapshot (resync) restates both tiers: the scores do not change.
    for worker in (device, host):
        worker.forwarder.resync(force=True)
    router.sync()
    assert router.route(prompt, request_id="again").prefill_scores == scores
