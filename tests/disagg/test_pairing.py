"""Pairing guards: workers whose KV bytes would not mean the same thing refuse to pair."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.services.handoff.pairing import PairingError, PairingInfo, check_pairing
from tests.disagg.cluster import local_pair

BASE = PairingInfo(worker_id="p0", role="prefill", model_id="smollm2-135m", dtype="float32",
                   block_size=16, kv_layout="block-major", num_layers=30, num_kv_heads=3,
                   head_dim=64, hash_scheme="sha256-v1", transport="nixl")
DECODE = dataclasses.replace(BASE, worker_id="d0", role="decode")


def test_block_size_mismatch_fails_at_pairing(loaded_model):
    async def scenario() -> None:
        async with local_pair(loaded_model, "tcp", decode_engine={"block_size": 32},
                              pair=False) as (p, d):
            with pytest.raises(PairingError, match=r"block size differs \(p0: 16, d0: 32\)"):
                await d.pair(p)
            assert not d.transport.has_peer("p0") and not p.peers

    asyncio.run(scenario())


@pytest.mark.parametrize(("field", "value", "message"), [
    ("model_id", "llama-3-8b", "model differs"),
    ("dtype", "bfloat16", "dtype differs"),
    ("block_size", 32, "block size differs"),
    ("kv_layout", "layer-major", "KV cache layout differs"),
    ("num_kv_heads", 8, r"KV cache layout \(KV heads\) differs"),
    ("hash_scheme", "sha256-v2", "block hash scheme differs"),
    ("transport", "tcp", "KV transport differs"),
    ("protocol_version", 2, "protocol version differs"),
])
def test_each_mismatch_is_named(field, value, message):
    with pytest.raises(PairingError, match=message):
        check_pairing(DECODE, dataclasses.replace(BASE, **{field: value}))


def test_every_mismatch_is_listed_and_roles_must_differ():
    other = dataclasses.replace(BASE, dtype="bfloat16", block_size=32)
    with pytest.raises(PairingError, match="dtype differs.*; block size differs"):
        check_pairing(DECODE, other)
    with pytest.raises(PairingError, match="one prefill and one decode"):
        check_pairing(BASE, dataclasses.replace(BASE, worker_id="p1"))
    check_pairing(DECODE, BASE)  # identical settings pair


def test_pairing_info_round_trips_and_rejects_bad_input():
    info = dataclasses.replace(BASE, transport_metadata={"host": "127.0.0.1", "port": 1})
    assert PairingInfo.from_dict(info.to_dict()) == info
    with pytest.raises(PairingError, match="malformed"):
        PairingInfo.from_dict({**info.to_dict(), "block_size": "16"})
    with pytest.raises(PairingError, match="malformed"):
        PairingInfo.from_dict({**info.to_dict(), "surprise": 1})
