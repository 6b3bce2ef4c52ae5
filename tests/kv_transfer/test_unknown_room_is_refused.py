"""Operations on rooms or peers a side does not know fail with UnknownRoomError / UnknownPeerError."""
from __future__ import annotations

import grpc
import pytest

from kv_inproc import InProcPair
from kv_transfer import UnknownPeerError, UnknownRoomError
from kv_transfer.wire.protogen import stubs
from kv_transfer.wire.messages import raise_if_error


def test_unknown_room_is_refused() -> None:
    pair = InProcPair("fake")
    try:
        with pytest.raises(UnknownRoomError):
            pair.prefill.sender(77)
        with pytest.raises(UnknownRoomError):
            pair.decode.receiver(77)

        pb2, pb2_grpc = stubs()
        with grpc.insecure_channel(f"127.0.0.1:{pair.port}") as channel:
            stub = pb2_grpc.KVBootstrapStub(channel)
            # A peer that never registered cannot open or abort rooms, nor heartbeat.
            reply = stub.OpenRoom(pb2.OpenRoomRequest(peer_id="nobody", room=1, dst_pages=[0]), timeout=5)
            with pytest.raises(UnknownPeerError):
                raise_if_error(reply, "test")
            reply = stub.Heartbeat(pb2.HeartbeatRequest(peer_id="nobody"), timeout=5)
            with pytest.raises(UnknownPeerError):
                raise_if_error(reply, "test")
            reply = stub.AbortRoom(pb2.AbortRoomRequest(peer_id="nobody", room=1, reason="x"), timeout=5)
            with pytest.raises(UnknownRoomError):
                raise_if_error(reply, "test")
            with pytest.raises(grpc.RpcError) as info:
                next(iter(stub.Subscribe(pb2.SubscribeRequest(peer_id="nobody"), timeout=5)))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

        # The manager still serves real rooms afterwards.
        receiver = pair.decode.create_receiver(3, "127.0.0.1", pair.port)
        receiver.init([5], aux_slot=0)
        sender = pair.prefill.create_sender(3)
        assert pair.prefill.sender(3) is sender and pair.decode.receiver(3) is receiver
    finally:
        pair.close()
