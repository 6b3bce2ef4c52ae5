"""A prefill worker with a cluster token answers only decode workers presenting the same token: a missing or
wrong one is refused before any handler runs (the room fails as ``refused``, naming the token), and a matching
one transfers as usual. Tokens may come from the environment or a file, never only the command line."""
from __future__ import annotations

import argparse

import pytest

from kv_harness import FAST
from kv_inproc import SHAPE, LocalPool
from kv_transfer import (AuxBuffer, ConfigError, DecodeTransferManager, PrefillTransferManager, RoomState,
                         TransferConfig, add_transfer_flags, transfer_config_from_args)
from tests.helpers import wait_until


def transfer(prefill_token: str, decode_token: str, room: int) -> tuple[RoomState, str | None]:
    src, dst, aux = LocalPool(1, SHAPE), LocalPool(2, SHAPE), AuxBuffer(4)
    base = {**FAST, "backend": "fake"}
    prefill = PrefillTransferManager(TransferConfig(**base, cluster_token=prefill_token), src.layout,
                                     bootstrap_port=0, bootstrap_host="127.0.0.1", worker_id="p")
    decode = DecodeTransferManager(TransferConfig(**base, cluster_token=decode_token), dst.layout, aux.layout,
                                   worker_id="d")
    try:
        receiver = decode.create_receiver(room, "127.0.0.1", prefill.port)
        receiver.init([3, 4], aux_slot=0)
        sender = prefill.create_sender(room)
        if wait_until(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT or receiver.poll().terminal, 5) \
                and sender.poll() == RoomState.WAITING_FOR_INPUT:
            sender.send([1, 2], last=True, first_token_id=9)
        wait_until(lambda: receiver.poll().terminal, 10)
        if receiver.poll() == RoomState.SUCCESS:
            assert dst.checksums([3, 4]) == src.checksums([1, 2])
        return receiver.poll(), receiver.failure_reason
    finally:
        decode.close()
        prefill.close()


def test_only_peers_with_the_cluster_token_are_answered() -> None:
    assert transfer("s3cret", "s3cret", 1)[0] == RoomState.SUCCESS
    for room, wrong in ((2, ""), (3, "guess")):
        state, reason = transfer("s3cret", wrong, room)
        assert state == RoomState.FAILED and "cluster token" in (reason or ""), reason
    assert transfer("", "anything", 4)[0] == RoomState.SUCCESS  # no token on the prefill side: open


def test_the_cluster_token_comes_from_a_flag_the_environment_or_a_file(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    def parse(*argv: str) -> TransferConfig:
        p = argparse.ArgumentParser()
        add_transfer_flags(p)
        return transfer_config_from_args(p.parse_args(list(argv)))
    assert parse().cluster_token == ""
    assert parse("--cluster-token", "flag").cluster_token == "flag"
    (tmp_path / "t").write_text("from-file\n")
    assert parse("--cluster-token-file", str(tmp_path / "t")).cluster_token == "from-file"
    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "from-env")
    assert parse().cluster_token == "from-env"
    monkeypatch.delenv("SPLITSERVE_CLUSTER_TOKEN")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        parse("--cluster-token-file", str(tmp_path / "empty"))
