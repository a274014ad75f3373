"""Control channel and KV handle encoding: JSON only, strict about what comes in."""

from __future__ import annotations

import asyncio
import pickle
import struct

import pytest

from tandem.loadtest.rpc_workers.rpc import RpcClient, RpcError, RpcServer
from tandem.services.handoff.prefill import LeaseTable
from tandem.services.kv_transfer.framing import FrameError, decode_header, encode_frame
from tandem.services.protocol.handoff import KVHandle, PrefillResult
from tests.disagg.cluster import FakeClock


def test_frames_are_json_objects_only():
    frame = encode_frame({"op": "read", "blocks": [1, 2]})
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert decode_header(frame[4:]) == {"op": "read", "blocks": [1, 2]}
    with pytest.raises(FrameError, match="not JSON"):
        decode_header(pickle.dumps({"op": "read"}))
    with pytest.raises(FrameError, match="JSON object"):
        decode_header(b"[1, 2]")


def test_kv_handle_round_trip_and_validation():
    handle = KVHandle("p0", "lease", (3, 4, 5), 40, (1, 2, 3))
    assert KVHandle.from_dict(handle.to_dict()) == handle
    result = PrefillResult("r", 7, None, 40, 16, handle)
    assert PrefillResult.from_dict(result.to_dict()) == result
    for bad in ({"block_ids": [3, -1]}, {"block_ids": [3.0]}, {"num_tokens": 0},
                {"checksums": [1]}, {"lease_id": None}):
        with pytest.raises(ValueError, match="malformed"):
            KVHandle.from_dict({**handle.to_dict(), **bad})


def test_rpc_errors_and_hangup_cancels_the_call():
    cancelled = asyncio.Event()

    async def echo(params):  # type: ignore[no-untyped-def]
        return params

    async def fail(params):  # type: ignore[no-untyped-def]
        raise LookupError("no such lease")

    async def slow(params):  # type: ignore[no-untyped-def]
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario() -> None:
        server = RpcServer({"echo": echo, "fail": fail, "slow": slow})
        await server.start()
        client = RpcClient("127.0.0.1", server.port, {"LookupError": LookupError})
        try:
            assert await client.call("echo", {"a": [1, "b"]}) == {"a": [1, "b"]}
            with pytest.raises(LookupError, match="no such lease"):
                await client.call("fail")
            with pytest.raises(RpcError, match="unknown method"):
                await client.call("nope")
            with pytest.raises(TimeoutError):
                await client.call("slow", timeout_s=0.2)
            await asyncio.wait_for(cancelled.wait(), 10)  # the server saw the hang-up
            assert await client.call("echo", {}) == {}
        finally:
            await client.close()
            await server.close()

    asyncio.run(scenario())


def test_lease_table_expires_on_its_clock():
    clock = FakeClock()
    table = LeaseTable(ttl_s=30, clock=clock)
    first = table.grant("a")
    clock.advance(10)
    second = table.grant("b")
    clock.advance(20)
    assert [lease.request_id for lease in table.take_expired()] == ["a"]
    assert table.take(first.lease_id) is None
    assert table.take(second.lease_id) == second and len(table) == 0
