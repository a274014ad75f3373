"""KV events on the wire are JSON with hex hashes and survive a round trip."""

from __future__ import annotations

import json

import pytest

from tandem.router.wire import WorkerEvent, decode_event, encode_event
from tandem.services.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

H1, H2 = bytes(range(32)), bytes(range(1, 33))


@pytest.mark.parametrize(
    "event",
    [
        BlockStored((H1, H2), None, 16),
        BlockStored((H2,), H1, 16),
        BlockRemoved((H1,)),
        AllBlocksCleared(),
    ],
)
def test_round_trip(event: object) -> None:
    raw = encode_event("w-1", event)  # type: ignore[arg-type]
    body = json.loads(raw)
    assert body["w"] == "w-1"
    assert decode_event(raw) == WorkerEvent("w-1", event)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"{}", b'{"v":1,"w":"a","k":"bogus"}', b'{"v":9,"w":"a","k":"cleared"}',
     b'{"v":1,"w":"a","k":"removed","h":["zz"]}'],
)
def test_malformed_input_raises_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_event(raw)


def test_hashes_are_hex_not_pickle() -> None:
    raw = encode_event("w", BlockStored((H1,), None, 16))
    assert H1.hex().encode() in raw
