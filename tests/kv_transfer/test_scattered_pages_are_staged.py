"""Scattered pages cross Mooncake through the decode side's staging slots: one block per slot, copied into
place before Success. Pages arrive intact, slots come back after aborted rooms, and the copy helpers are
checked against plain byte slicing on packed, strided and shuffled layouts."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kv_harness import open_room
from kv_transfer import KVLayout
from kv_transfer.errors import PageIndexError
from kv_transfer.staging import PageViews, StagingArea, StagingSlots

PAGE_ALL_LAYERS = 4 * 2 * 512  # default peer shape: 4 layers x K/V x 512-byte pages
SMALL_SLOTS = {"staging_slot_bytes": 3 * PAGE_ALL_LAYERS, "staging_slots": 2}  # 3 pages per slot


def _layout(base: int, kind: str, rng: random.Random, pages: int = 12) -> tuple[KVLayout, int]:
    """A 3-layer layout over memory at `base`; returns it and the bytes it spans."""
    page = 4 * 2 * 8 * 2  # page_size 4, 2 heads, dim 8, float16
    stride = page * 3 if kind == "strided" else page
    buffer = (pages - 1) * stride + page
    order = list(range(6))
    if kind == "shuffled":
        rng.shuffle(order)
    addrs = [base + i * buffer for i in order]
    layout = KVLayout(num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, dtype="float16", num_pages=pages,
                      k_base=tuple(addrs[:3]), v_base=tuple(addrs[3:]), page_stride=stride if kind == "strided" else 0)
    return layout, 6 * buffer


@pytest.mark.parametrize("kind", ["packed", "strided", "shuffled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_then_scatter_moves_exactly_the_listed_pages(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    src_mem = np.random.default_rng(seed).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst_mem = np.random.default_rng(seed + 100).integers(0, 256, 1 << 16, dtype=np.uint8)
    src, span = _layout(int(src_mem.ctypes.data), kind, rng)
    dst, _ = _layout(int(dst_mem.ctypes.data), kind, random.Random(seed))  # same shuffle as src
    assert span <= src_mem.nbytes
    before = dst_mem.copy()
    src_pages, dst_pages = rng.sample(range(12), 5), rng.sample(range(12), 5)
    block = np.zeros(5 * 6 * src.page_bytes, dtype=np.uint8)
    assert PageViews(src).gather(src_pages, block) == block.nbytes
    PageViews(dst).scatter(block, dst_pages)

    def page_of(mem: np.ndarray, layout: KVLayout, buf: int, page: int, origin: np.ndarray | None = None) -> bytes:
        """Page `page` of buffer `buf`, read from `mem` (or a copy of it, then `origin` is the original)."""
        off = layout.bases()[buf] - int((mem if origin is None else origin).ctypes.data) + page * layout.stride
        return mem[off:off + layout.page_bytes].tobytes()

    for b in range(6):
        for i, (s, d) in enumerate(zip(src_pages, dst_pages)):
            # slot format: buffer-major, the listed pages back to back
            start = (b * 5 + i) * src.page_bytes
            assert block[start:start + src.page_bytes].tobytes() == page_of(src_mem, src, b, s)
            assert page_of(dst_mem, dst, b, d) == page_of(src_mem, src, b, s)
        for p in set(range(12)) - set(dst_pages):
            assert page_of(dst_mem, dst, b, p) == page_of(before, dst, b, p, origin=dst_mem)


def test_a_slot_rejects_more_pages_than_it_holds() -> None:
    mem = np.zeros(1 << 16, dtype=np.uint8)
    layout, _ = _layout(int(mem.ctypes.data), "packed", random.Random(0))
    views = PageViews(layout)
    area = StagingArea(2 * views.bytes_per_page, 2, views)
    with pytest.raises(PageIndexError):
        area.unstage(0, [1, 2, 3])
    with pytest.raises(PageIndexError):
        area.unstage(2, [1])
    slots = StagingSlots(0, 2 * views.bytes_per_page, 2, views)
    taken = {slots.acquire(1.0, lambda: False), slots.acquire(1.0, lambda: False)}
    assert taken == {0, 1} and slots.acquire(0.05, lambda: False) is None  # both busy: times out
    slots.release(1)
    with pytest.raises(PageIndexError):
        slots.release(1)  # freeing a free slot is a protocol error
    assert slots.acquire(1.0, lambda: False) == 1


@pytest.mark.parametrize("staging", ["on", "off"])
def test_scattered_pages_arrive_intact_through_staging_slots(spawn, staging: str) -> None:
    config = SMALL_SLOTS if staging == "on" else {"staging_slot_bytes": 0}
    prefill = spawn("prefill", "mooncake", seed=1, pages=64, config=config)
    decode = spawn("decode", "mooncake", seed=2, pages=64, config=config)
    rng = random.Random(3)
    for room in (1, 2):
        src, dst = rng.sample(range(64), 20), rng.sample(range(64), 20)
        before = decode.call("checksums", pages=list(range(64)))["sums"]
        open_room(prefill, decode, room, dst, aux_slot=room)
        for part, last in ((src[:7], False), (src[7:], True)):  # chunks that do not align with slots
            prefill.call("send", room=room, pages=part, last=last, first_token=room, cached=0)
        assert decode.wait(room, ["SUCCESS", "FAILED"], 20)["state"] == "SUCCESS"
        after = decode.call("checksums", pages=list(range(64)))["sums"]
        assert [after[d] for d in dst] == prefill.call("checksums", pages=src)["sums"]
        assert all(after[p] == before[p] for p in set(range(64)) - set(dst))
    staged = prefill.call("metrics")["staged_bytes_total"]
    assert staged == (40 * PAGE_ALL_LAYERS if staging == "on" else 0)


def test_a_room_aborted_mid_transfer_gives_its_slots_back(spawn) -> None:
    config = {**SMALL_SLOTS, "staging_slots": 1}  # one slot: a leaked slot would stall every later room
    prefill = spawn("prefill", "mooncake", seed=1, pages=64, config=config)
    decode = spawn("decode", "mooncake", seed=2, pages=64, config=config)
    open_room(prefill, decode, 1, list(range(40, 52)))
    prefill.call("send", room=1, pages=list(range(6)))  # two slots' worth, written one after the other
    decode.call("abort", room=1, reason="client went away")
    assert prefill.wait(1, ["FAILED"], 10)["state"] == "FAILED"
    prefill.call("release", room=1)
    decode.call("release", room=1)
    for room in (2, 3):
        open_room(prefill, decode, room, [room * 10, room * 10 + 5, room * 10 + 2, room * 10 + 7])
        prefill.call("send", room=room, pages=[1, 9, 4, 30], last=True, first_token=room)
        assert decode.wait(room, ["SUCCESS", "FAILED"], 20)["state"] == "SUCCESS"
        assert prefill.wait(room, ["SUCCESS", "FAILED"], 5)["state"] == "SUCCESS"
