"""`auto` uses shm when the prefill side can map the decode side's segment, else Mooncake; strict backends
that cannot work across the given boundary are refused with TransportMismatchError."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kv_harness import FAST, run_room
from kv_transfer import ConfigError, SharedSegment, TransferConfig, TransportMismatchError
from kv_transfer.transport.select import Offer, ReceiveSide, SendSide


def test_auto_between_processes_on_one_host_uses_shm(spawn) -> None:
    prefill = spawn("prefill", "auto", seed=1)
    decode = spawn("decode", "auto", seed=2)
    assert decode.call("connect", port=prefill.port)["transport"] == "shm"
    run_room(prefill, decode, 1, [1, 2, 9], [3, 4, 5])


def test_auto_falls_back_to_mooncake_when_the_segment_is_not_ours() -> None:
    """A segment with the same name but another nonce is what a different host (or /dev/shm) looks like."""
    seg = SharedSegment.create(1 << 16)
    src = np.zeros(1 << 12, dtype=np.uint8)
    try:
        config = TransferConfig(**{**FAST, "backend": "auto"})
        receive = ReceiveSide(config, [(seg.address, 4096)], [seg])
        assert receive.offer.mooncake_session and receive.offer.shm_regions
        name, _nonce, base, size = receive.offer.shm_regions[0]
        foreign = Offer(mooncake_session=receive.offer.mooncake_session,
                        shm_regions=((name, os.urandom(16), base, size),))
        send = SendSide(config, [(int(src.ctypes.data), src.nbytes)])
        assert send.writer_for(foreign, "peer").transport == "mooncake"
        assert send.writer_for(receive.offer, "peer").transport == "shm"

        strict = SendSide(TransferConfig(**{**FAST, "backend": "shm"}), [])
        with pytest.raises(TransportMismatchError, match="one host"):
            strict.writer_for(foreign, "peer")
        receive.close()
    finally:
        seg.close()


def test_backends_without_a_common_transport_are_refused() -> None:
    shm_only = Offer(shm_regions=(("splitserve-kv-1-00", b"x" * 16, 0, 1),))
    with pytest.raises(TransportMismatchError, match="offers shm"):
        SendSide(TransferConfig(**{**FAST, "backend": "mooncake"}), []).writer_for(shm_only, "peer")
    other_process = Offer(fake_session="fake-1-1")
    with pytest.raises(TransportMismatchError, match="in-process"):
        SendSide(TransferConfig(**{**FAST, "backend": "fake"}), []).writer_for(other_process, "peer")
    with pytest.raises(ConfigError, match="SharedSegment"):
        ReceiveSide(TransferConfig(**{**FAST, "backend": "shm"}), [(1, 1)], [])
