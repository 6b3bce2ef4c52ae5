"""A decode worker whose KV layout differs is refused at the handshake, with the field and both values named."""
from __future__ import annotations

import pytest

from kv_harness import PeerError

BASE = dict(layers=4, pages=32, page_size=4, heads=2, dim=16, dtype="float32")


@pytest.mark.parametrize(
    ("field", "decode_override", "local", "remote"),
    [
        ("head_dim", {"dim": 32}, "32", "16"),
        ("num_kv_heads", {"heads": 4}, "4", "2"),
        ("num_layers", {"layers": 2}, "2", "4"),
        ("page_size", {"page_size": 8}, "8", "4"),
        ("dtype", {"dtype": "bfloat16"}, "bfloat16", "float32"),
    ],
)
def test_layout_mismatch_is_refused(spawn, field: str, decode_override: dict, local: str, remote: str) -> None:
    prefill = spawn("prefill", "mooncake", **BASE)
    decode = spawn("decode", "mooncake", **{**BASE, **decode_override})
    with pytest.raises(PeerError) as info:
        decode.call("connect", port=prefill.port)
    err = info.value.reply
    assert info.value.type == "LayoutMismatchError"
    # From the decode side's point of view: local = its own value, remote = the prefill's.
    assert (err["field"], err["local"], err["remote"]) == (field, local, remote)
    assert field in err["message"] and local in err["message"] and remote in err["message"]

    # A room to that prefill fails with the same reason instead of hanging.
    decode.call("recv", room=5, port=prefill.port, pages=[0, 1], aux_slot=0)
    got = decode.wait(5, ["FAILED", "SUCCESS"], 5)
    assert got["state"] == "FAILED" and got["kind"] == "refused" and got["error"] == "LayoutMismatchError"
    assert field in got["reason"]


def test_matching_layout_with_different_pool_size_is_accepted(spawn) -> None:
    prefill = spawn("prefill", "shm", **BASE)
    decode = spawn("decode", "shm", **{**BASE, "pages": 96})
    assert decode.call("connect", port=prefill.port)["transport"] == "shm"
