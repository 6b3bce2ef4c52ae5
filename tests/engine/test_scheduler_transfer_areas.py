"""The scheduler's disaggregation areas: requests waiting for pages to receive KV into, reserved requests
whose KV is arriving, and finished requests whose pages a transfer still reads."""
from __future__ import annotations

from engine.request import Abort, Status
from tests.engine.test_scheduler import PAGE, make_req, make_scheduler, run_all


def test_reservations_never_overcommit_and_keep_headroom() -> None:
    s = make_scheduler(num_pages=1 + 20)  # 20 pages
    reqs = [make_req(f"r{i}", 16) for i in range(4)]  # 4 pages of prompt each
    for r in reqs:
        s.add_for_transfer(r)
    got = s.reserve_for_transfer(reserve_tokens=4 * PAGE, max_rooms=8)
    # r0 takes 4 pages and keeps 4 free; r1 takes 4 and must keep 8 free (its own 4 and r0's); r2 would need 12
    assert got == reqs[:2]
    assert list(s.kv_queue) == reqs[2:] and s.kv.allocator.available == 12
    s.check_integrity()
    assert s.reserve_for_transfer(reserve_tokens=0, max_rooms=2) == []  # max_rooms reached
    assert s.reserve_for_transfer(reserve_tokens=0, max_rooms=8) == reqs[2:]


def test_activation_joins_the_decode_batch_from_the_first_token() -> None:
    s = make_scheduler()
    r = make_req("r", 10, max_new=3)
    s.add_for_transfer(r)
    assert s.reserve_for_transfer(0, 4) == [r]
    s.activate(r, 42)
    assert r.kv_len == 10 and r.output_ids == [42] and r in s.running
    run_all(s)
    assert r.output_ids == [42, 7, 7] and r.finish_reason == "length"


def test_first_token_that_stops_finishes_without_decoding() -> None:
    s = make_scheduler()
    r = make_req("r", 10)
    s.add_for_transfer(r)
    s.reserve_for_transfer(0, 4)
    s.activate(r, 0)  # 0 is EOS in the factory
    assert r.finish_reason == "stop" and not s.running and not s.has_pending
    s.kv.cache.flush()
    assert s.kv.allocator.available == s.kv.allocator.capacity


def test_next_turn_reserves_only_pages_the_decode_cache_lacks() -> None:
    s = make_scheduler()
    first = make_req("t1", list(range(100, 120)), max_new=4)
    s.add_for_transfer(first)
    s.reserve_for_transfer(0, 4)
    s.activate(first, 50)
    run_all(s)
    history = first.prompt_ids + first.output_ids  # 24 tokens; KV of 23 of them exists
    second = make_req("t2", history + list(range(300, 310)))
    s.add_for_transfer(second)
    s.reserve_for_transfer(0, 4)
    assert second.kv_len == (23 // PAGE) * PAGE == 20  # held prefix, page aligned
    assert len(second.pages) == -(-34 // PAGE) and second.num_cached_pages == 5


def test_held_pages_stay_until_released_and_aborts_in_prealloc_free_pages() -> None:
    s = make_scheduler(chunk=64, budget=64)
    p = make_req("p", 10, max_new=1)
    p.hold_kv = True
    s.add(p)
    run_all(s, limit=3)
    assert p.finished and s.held == [p] and p.pages
    s.check_integrity()
    s.release_held(p)
    d = make_req("d", 12)
    s.add_for_transfer(d)
    s.reserve_for_transfer(0, 4)
    assert s.abort("d", Abort(499, "gone")) is d and d.status is Status.FINISHED and not s.prealloc
    s.check_integrity()
    s.kv.cache.flush()
    assert s.kv.allocator.available == s.kv.allocator.capacity
