"""Scattered pages cross Mooncake through the decode side's staging slots: one block per slot, copied into
place before Success. Pages arrive intact, slots come back after aborted rooms and failed writes, and a slot
refuses what it cannot hold."""
from __future__ import annotations

import random
from typing import Callable

import numpy as np
import pytest
from kv_harness import open_room

from kv_transfer import KVLayout, TransferConfig
from kv_transfer.wire.aux import AuxBuffer, AuxStaging
from kv_transfer.wire.errors import PageIndexError, TransferIOError
from kv_transfer.metrics import TransferMetrics
from kv_transfer.page_views import PageViews
from kv_transfer.prefill.peers import DecodePeer
from kv_transfer.prefill.page_writers import DirectPageWriter, StagedPageWriter
from kv_transfer.prefill.sender import KVSender
from kv_transfer.staging import StagingArea, StagingSlots
from kv_transfer.state import FailureKind
from kv_transfer.transport import fake
from tests.helpers import wait_until

PAGE_ALL_LAYERS = 4 * 2 * 512  # default peer shape: 4 layers x K/V x 512-byte pages
SMALL_SLOTS = {"staging_slot_bytes": 3 * PAGE_ALL_LAYERS, "staging_slots": 2}  # 3 pages per slot


def test_a_slot_rejects_more_pages_than_it_holds() -> None:
    mem = np.zeros(1 << 16, dtype=np.uint8)
    layout = KVLayout.packed(int(mem.ctypes.data), num_layers=3, num_pages=12, page_size=4, num_kv_heads=2,
                             head_dim=8, dtype="float16")
    views = PageViews(layout)
    area = StagingArea(2 * views.bytes_per_page, 2, views)
    with pytest.raises(PageIndexError):
        area.unstage(0, [1, 2, 3])
    with pytest.raises(PageIndexError):
        area.unstage(2, [1])
    slots = StagingSlots(0, 2 * views.bytes_per_page, 2, views, lambda entries: lambda: None)
    taken = {slots.acquire(1.0, lambda: False), slots.acquire(1.0, lambda: False)}
    assert taken == {0, 1} and slots.acquire(0.05, lambda: False) is None  # both busy: times out
    with pytest.raises(PageIndexError):
        slots.release(1)  # not announced yet: the decode side cannot have copied it out
    slots.announce(1)
    slots.release(1)
    with pytest.raises(PageIndexError):
        slots.release(1)  # freeing it twice is a protocol error
    assert slots.acquire(1.0, lambda: False) == 1
    # a slot whose write failed is retired; with every slot retired the peer is written to directly
    assert slots.worth_it(512) and not slots.worth_it(4 << 20)  # small entries are staged, large ones not
    slots.give_back(0, written=True)
    slots.give_back(1, written=True)
    assert not slots.worth_it(512) and slots.free_slots == 0
    slots.close()
    assert slots.acquire(1.0, lambda: False) is None  # a closed peer hands out nothing


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


def _second_write_fails() -> Callable[[list[tuple[int, int, int]]], Callable[[], None]]:
    """A stand-in for Mooncake's start_write (a real write cannot be made to fail on cue): writes nothing, and
    the second write's completion reports a failure."""
    started = [0]

    def start_write(entries: list[tuple[int, int, int]]) -> Callable[[], None]:
        started[0] += 1
        n = started[0]

        def wait() -> None:
            if n == 2:
                raise TransferIOError("injected: the second staged write failed", rc=-1)
        return wait
    return start_write


def test_a_failed_staged_write_fails_the_room_and_loses_no_slot() -> None:
    mem = np.zeros(1 << 18, dtype=np.uint8)
    layout = KVLayout.packed(int(mem.ctypes.data), num_layers=2, num_pages=16, page_size=4, num_kv_heads=2,
                             head_dim=8, dtype="float16")
    views = PageViews(layout)
    staging = StagingSlots(int(mem.ctypes.data), 2 * views.bytes_per_page, 3, views,  # 2 pages per slot
                           _second_write_fails())
    aux = AuxBuffer(4)
    session = fake.register_session([(int(mem.ctypes.data), mem.nbytes), (aux.layout.base, aux.layout.total_bytes)])
    transport, metrics = fake.FakeWriter(session), TransferMetrics("prefill")
    pages = DirectPageWriter(layout, layout, transport, metrics, 1024,
                             StagedPageWriter(staging, metrics, "decode-0", slot_timeout=15.0))
    peer = DecodePeer("peer", "decode-0", layout, aux.layout, transport, AuxStaging(4), metrics, pages, staging)
    sender = KVSender(7, TransferConfig(backend="mooncake"), layout, lambda *a: None, lambda *a: None)
    sender.attach(peer, tuple(range(8, 14)), 0, 0)
    sender.claim()
    assert sender.send([0, 1, 2, 3, 4, 5])  # three slots: the first and third writes succeed
    assert wait_until(lambda: sender.state.terminal, 10)
    assert sender.failure is not None and sender.failure.kind == FailureKind.TRANSFER_IO
    assert "injected" in sender.failure.message
    staged = []
    while not peer.events.empty():
        event = peer.events.get()
        if event is not None and event.HasField("staged"):
            staged.append(event.staged.slot)
    assert len(staged) == 2  # both completed writes were announced, so the decode side frees their slots
    for slot in staged:
        staging.release(slot)
    assert staging.free_slots == 2  # the failed write's slot is retired, nothing else is lost
    peer.close()
    fake.unregister_session(session)
