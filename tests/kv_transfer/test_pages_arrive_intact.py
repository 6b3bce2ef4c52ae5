"""Random contiguous and scattered page sets arrive byte-exact with every backend; other pages are untouched."""
from __future__ import annotations

import random

import pytest
from kv_inproc import InProcPair

from kv_transfer import RoomState
from tests.helpers import wait_until

PAGES = 512  # scattered sets of ~200 pages over 8 K/V buffers give >1024 entries: batches must be split
SHAPE = dict(layers=4, pages=PAGES, page_size=4, heads=2, dim=16, dtype="float32")


def page_sets(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    start_s, start_d = rng.randrange(0, PAGES - 64), rng.randrange(0, PAGES - 64)
    contiguous = (list(range(start_s, start_s + 64)), list(range(start_d, start_d + 64)))
    scattered = (rng.sample(range(PAGES), 200), rng.sample(range(PAGES), 200))
    return {"contiguous": contiguous, "scattered": scattered}


def chunks(pages: list[int], n: int) -> list[list[int]]:
    size = (len(pages) + n - 1) // n
    return [pages[i:i + size] for i in range(0, len(pages), size)]


@pytest.mark.parametrize("backend", ["mooncake", "shm"])
def test_pages_arrive_intact_across_processes(spawn, backend: str) -> None:
    prefill = spawn("prefill", backend, seed=1, **SHAPE)
    decode = spawn("decode", backend, seed=2, **SHAPE)
    assert decode.call("connect", port=prefill.port)["transport"] == backend
    for room, (kind, (src, dst)) in enumerate(page_sets(7).items(), start=100):
        before = decode.call("checksums", pages=list(range(PAGES)))["sums"]
        decode.call("recv", room=room, port=prefill.port, pages=dst, aux_slot=room % 16)
        prefill.call("sender", room=room)
        assert prefill.wait(room, ["WAITING_FOR_INPUT"], 5)["state"] == "WAITING_FOR_INPUT"
        assert prefill.call("dst", room=room)["dst"] == dst
        parts = chunks(src, 3)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            prefill.call("send", room=room, pages=part, last=last, first_token=room + 5, cached=3 if last else 0)
        got = decode.wait(room, ["SUCCESS", "FAILED"], 20)
        assert got["state"] == "SUCCESS", (kind, got)
        assert got["aux"] == [room + 5, 3, room]
        assert prefill.wait(room, ["SUCCESS", "FAILED"], 5)["state"] == "SUCCESS"
        after = decode.call("checksums", pages=list(range(PAGES)))["sums"]
        src_sums = prefill.call("checksums", pages=src)["sums"]
        assert [after[d] for d in dst] == src_sums, kind
        untouched = set(range(PAGES)) - set(dst)
        assert all(after[p] == before[p] for p in untouched), kind


def test_pages_arrive_intact_with_fake_backend() -> None:
    shape = dict(num_layers=4, num_pages=PAGES, page_size=4, num_kv_heads=2, head_dim=16, dtype="float32")
    pair = InProcPair("fake", shape, shape)
    try:
        for room, (kind, (src, dst)) in enumerate(page_sets(11).items(), start=200):
            before = pair.dst.checksums(list(range(PAGES)))
            receiver = pair.decode.create_receiver(room, "127.0.0.1", pair.port)
            receiver.init(dst, aux_slot=1)
            sender = pair.prefill.create_sender(room)
            assert wait_until(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT, 5)
            parts = chunks(src, 4)
            for i, part in enumerate(parts):
                assert sender.send(part, last=i == len(parts) - 1, first_token_id=9, cached_tokens=0)
            assert wait_until(lambda: receiver.poll().terminal, 10)
            assert receiver.poll() == RoomState.SUCCESS, receiver.failure_reason
            after = pair.dst.checksums(list(range(PAGES)))
            assert [after[d] for d in dst] == pair.src.checksums(src), kind
            assert all(after[p] == before[p] for p in set(range(PAGES)) - set(dst)), kind
            assert receiver.aux_record is not None and receiver.aux_record.room == room
    finally:
        pair.close()
