"""A bootstrap address nobody listens on fails rooms quickly with a typed error; live peers still work."""
from __future__ import annotations

import socket
import time

import pytest

from kv_harness import PeerError


def _closed_port() -> int:
    from deploy.process import free_ports
    return free_ports(1)[0]


def test_unreachable_peer_fails_fast(spawn) -> None:
    decode = spawn("decode", "mooncake", seed=2)
    port = _closed_port()
    with pytest.raises(PeerError) as info:
        decode.call("connect", port=port)
    assert info.value.type == "PeerUnreachableError"
    assert f"127.0.0.1:{port}" in info.value.reply["message"]

    start = time.monotonic()
    decode.call("recv", room=1, port=port, pages=[0, 1], aux_slot=0)
    got = decode.wait(1, ["FAILED", "SUCCESS"], 5)
    assert got["state"] == "FAILED" and got["kind"] == "peer_unreachable", got
    assert time.monotonic() - start < 5

    prefill = spawn("prefill", "mooncake", seed=1)
    decode.call("recv", room=2, port=prefill.port, pages=[0, 1], aux_slot=0)
    prefill.call("sender", room=2)
    assert prefill.wait(2, ["WAITING_FOR_INPUT"], 5)["state"] == "WAITING_FOR_INPUT"
    prefill.call("send", room=2, pages=[3, 4], last=True, first_token=1)
    assert decode.wait(2, ["SUCCESS", "FAILED"], 5)["state"] == "SUCCESS"


def test_silent_listener_fails_within_rpc_deadline(spawn) -> None:
    """A port that accepts connections but never answers (Mooncake would block 61 s) fails in our deadline."""
    decode = spawn("decode", "mooncake", seed=2)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        start = time.monotonic()
        decode.call("recv", room=3, port=port, pages=[0], aux_slot=0)
        got = decode.wait(3, ["FAILED", "SUCCESS"], 10)
    assert got["state"] == "FAILED" and got["kind"] == "peer_unreachable", got
    assert time.monotonic() - start < 10
