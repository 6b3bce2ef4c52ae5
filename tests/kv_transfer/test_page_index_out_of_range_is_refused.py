"""Page indices or aux slots outside a pool are refused before anything is written."""
from __future__ import annotations

import pytest
from kv_harness import PeerError
from kv_inproc import SHAPE, InProcPair

from kv_transfer import AuxBuffer, PageIndexError, RoomState
from kv_transfer.wire.protogen import stubs
from kv_transfer.wire.messages import aux_to_msg, layout_to_msg, offer_to_msg, raise_if_error
from tests.helpers import wait_until

PAGES = 64


def test_receiver_refuses_out_of_range_pages(spawn) -> None:
    prefill = spawn("prefill", "mooncake", seed=1, pages=PAGES)
    decode = spawn("decode", "mooncake", seed=2, pages=PAGES)
    for pages, slot in (([0, PAGES], 0), ([-1], 0), ([3, 3], 0), ([1], 16)):
        with pytest.raises(PeerError) as info:
            decode.call("recv", room=1, port=prefill.port, pages=pages, aux_slot=slot)
        assert info.value.type == "PageIndexError", pages
        decode.call("release", room=1)


def test_sender_refuses_out_of_range_and_surplus_pages(spawn) -> None:
    prefill = spawn("prefill", "mooncake", seed=1, pages=PAGES)
    decode = spawn("decode", "mooncake", seed=2, pages=PAGES)
    before = decode.call("checksums", pages=list(range(PAGES)))["sums"]
    decode.call("recv", room=9, port=prefill.port, pages=[10, 11], aux_slot=0)
    prefill.call("sender", room=9)
    assert prefill.wait(9, ["WAITING_FOR_INPUT"], 5)["state"] == "WAITING_FOR_INPUT"
    for pages, last in (([PAGES], False), ([1, 2, 3], False), ([1], True)):
        with pytest.raises(PeerError) as info:
            prefill.call("send", room=9, pages=pages, last=last, first_token=1)
        assert info.value.type == "PageIndexError", pages
    assert decode.call("checksums", pages=list(range(PAGES)))["sums"] == before  # nothing written
    # The room is still usable with correct input.
    prefill.call("send", room=9, pages=[20, 21], last=True, first_token=1)
    assert decode.wait(9, ["SUCCESS", "FAILED"], 5)["state"] == "SUCCESS"


def test_prefill_server_refuses_out_of_range_pages_from_the_wire() -> None:
    """A decode peer that skips its own checks still cannot make the prefill side write out of bounds."""
    import grpc

    pair = InProcPair("fake")
    pb2, pb2_grpc = stubs()
    aux = AuxBuffer(4)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
            stub = pb2_grpc.KVBootstrapStub(channel)
            offer = pair.decode._receive_side.offer  # the real decode manager's registered memory
            reply = stub.RegisterPeer(pb2.RegisterPeerRequest(
                peer_id="raw", worker="raw", layout=layout_to_msg(pair.dst.layout), aux=aux_to_msg(aux.layout),
                offer=offer_to_msg(offer)), timeout=5)
            raise_if_error(reply, "raw")
            for pages, slot in (([SHAPE["num_pages"]], 0), ([0, 2**40], 0), ([1], 4)):
                reply = stub.OpenRoom(pb2.OpenRoomRequest(peer_id="raw", room=5, dst_pages=pages, aux_slot=slot),
                                      timeout=5)
                with pytest.raises(PageIndexError):
                    raise_if_error(reply, "raw")
        with pytest.raises(Exception):
            pair.prefill.sender(5)
        # Real rooms keep working.
        r = pair.decode.create_receiver(6, "127.0.0.1", pair.port)
        r.init([1], aux_slot=0)
        s = pair.prefill.create_sender(6)
        assert wait_until(lambda: s.poll() == RoomState.WAITING_FOR_INPUT, 5)
        s.send([2], last=True, first_token_id=3)
        assert wait_until(lambda: r.poll() == RoomState.SUCCESS, 5), r.failure_reason
    finally:
        pair.close()
