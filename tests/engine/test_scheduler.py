"""Scheduler behaviour with CPU factories and no model: chunked prefill interleaved with decodes, budgets,
admission against free pages, retraction of the newest request, policies, n > 1 groups and aborts."""
from __future__ import annotations

from engine.config import SchedulerConfig
from engine.mem.allocator import PageAllocator
from engine.mem.base import NoPrefixCache
from engine.mem.radix_cache import RadixCache
from engine.request import Abort, Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler

PAGE = 4


def make_scheduler(num_pages: int = 256, chunk: int = 16, budget: int = 32, max_running: int = 64,
                   policy: str = "fcfs", cache: bool = True) -> Scheduler:
    alloc = PageAllocator(num_pages)
    prefix = RadixCache(PAGE, alloc.free) if cache else NoPrefixCache(PAGE)
    cfg = SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=budget, max_running_requests=max_running,
                          schedule_policy=policy)
    return Scheduler(cfg, alloc, prefix, PAGE, eos_token_ids=(0,))


def make_req(rid: str, prompt: list[int] | int, max_new: int = 8, leader: Request | None = None) -> Request:
    ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid=rid, prompt_ids=ids, sampling=SamplingParams(max_new_tokens=max_new), max_new_tokens=max_new,
                   group_leader=leader)


def step(s: Scheduler, token: int = 7) -> ScheduledBatch | None:
    batch = s.schedule()
    if batch is not None:
        s.update(batch, {seq.req: [token] for seq in batch.seqs if seq.sample})
        s.check_integrity()
    return batch


def run_all(s: Scheduler, limit: int = 1000) -> int:
    for n in range(limit):
        if not s.has_work:
            return n
        step(s)
    raise AssertionError("did not drain")


def test_long_prefill_is_chunked_and_never_stalls_running_decodes() -> None:
    s = make_scheduler(chunk=16, budget=16)
    a, b = make_req("a", 5, max_new=50), make_req("b", 6, max_new=50)
    s.add(a), s.add(b)
    step(s)
    assert a.prefill_done and b.prefill_done
    long = make_req("long", list(range(1000, 1100)), max_new=2)
    s.add(long)
    chunks = 0
    while not long.prefill_done:
        batch = step(s)
        assert batch is not None
        by_req = {seq.req.rid: seq for seq in batch.seqs}
        assert by_req["a"].num_tokens == 1 and by_req["b"].num_tokens == 1, "decodes ran every step"
        assert by_req["long"].num_tokens <= 16
        chunks += 1
    assert chunks == 7  # ceil(100 / 16)
    assert len(a.output_ids) == 1 + chunks and long.kv_len == 100


def test_forced_output_tokens_run_with_the_decodes_even_when_prompts_fill_the_budget() -> None:
    s = make_scheduler(chunk=16, budget=16)
    a = make_req("a", 5, max_new=50)
    s.add(a)
    step(s)
    s.add(make_req("long", list(range(1000, 1100)), max_new=2))
    step(s)  # the long prompt now takes the whole prefill budget every step
    assert s.append_forced(a, [11, 12, 13, 14])  # a grammar's fixed continuation
    batch = step(s)
    by_req = {seq.req.rid: seq for seq in batch.seqs}
    assert by_req["a"].num_tokens == 5 and by_req["a"].sample, "the forced run and the next token, in one step"
    assert by_req["long"].num_tokens == 16  # the prompt's chunk kept its budget
    assert a.output_ids[-5:-1] == [11, 12, 13, 14] and a.remaining == 1


def test_prefill_budget_is_shared_across_new_requests() -> None:
    s = make_scheduler(chunk=32, budget=20)
    for i in range(3):
        s.add(make_req(f"r{i}", 12))
    batch = step(s)
    assert batch is not None and batch.num_tokens == 20  # 12 + 8 (chunked), third waits
    assert [seq.num_tokens for seq in batch.seqs] == [12, 8]
    assert len(s.waiting) == 1


def test_a_step_that_prompts_fill_runs_as_sub_steps_with_the_decodes_on_the_last() -> None:
    s = make_scheduler(chunk=16, budget=48)
    a = make_req("a", 5, max_new=50)
    s.add(a)
    step(s)
    prompts = [make_req(f"p{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 16)), max_new=4) for i in range(6)]
    for p in prompts:
        s.add(p)
    steps = [[(seq.req.rid, seq.num_tokens) for seq in step(s).seqs] for _ in range(6)]
    # 48 tokens of prompts between two of a's tokens, as one whole step would have run them, 16 a sub-step
    assert steps[:3] == [[("p0", 16)], [("p1", 16)], [("a", 1), ("p0", 1), ("p1", 1), ("p2", 16)]]
    assert steps[3:5] == [[("p3", 16)], [("p4", 16)]]
    assert steps[5] == [("a", 1), ("p0", 1), ("p1", 1), ("p2", 1), ("p3", 1), ("p4", 1), ("p5", 16)]
    assert len(prompts[0].output_ids) == 3  # its first token came after the first sub-step, not the third


def test_decodes_are_not_held_back_when_the_prompts_would_not_fill_the_step() -> None:
    s = make_scheduler(chunk=16, budget=48)
    a = make_req("a", 5, max_new=50)
    s.add(a)
    step(s)
    s.add(make_req("long", 100, max_new=2))  # one prompt: one chunk a step, far under the budget
    s.add(make_req("short", 8, max_new=2))
    for _ in range(3):
        assert ("a", 1) in [(seq.req.rid, seq.num_tokens) for seq in step(s).seqs]


def test_decodes_run_when_no_waiting_prompt_can_be_admitted() -> None:
    s = make_scheduler(num_pages=1 + 8, chunk=16, budget=48)  # 8 usable pages = 32 tokens
    a = make_req("a", 5, max_new=20)
    s.add(a)
    step(s)
    for i in range(4):
        s.add(make_req(f"big{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 30)), max_new=2))  # 8 pages each
    for _ in range(3):
        batch = step(s)
        assert batch is not None and [(seq.req.rid, seq.num_tokens) for seq in batch.seqs] == [("a", 1)]


def test_without_chunking_a_long_prompt_runs_whole_and_alone() -> None:
    s = make_scheduler(chunk=-1, budget=16)
    s.add(make_req("long", 40))
    s.add(make_req("short", 4))
    batch = step(s)
    assert batch is not None and [(q.req.rid, q.num_tokens) for q in batch.seqs] == [("long", 40)]


def test_admission_waits_when_pages_are_short_and_never_overcommits() -> None:
    s = make_scheduler(num_pages=1 + 12, chunk=64, budget=64)  # 12 usable pages = 48 tokens
    reqs = [make_req(f"r{i}", 16, max_new=4) for i in range(6)]  # each needs 5 pages at its end
    for r in reqs:
        s.add(r)
    step(s)
    assert 1 <= len(s.running) <= 3 and len(s.waiting) >= 3
    run_all(s)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in reqs)
    s.kv.cache.flush()
    assert s.kv.allocator.available == s.kv.allocator.capacity


def test_out_of_pages_retracts_the_newest_and_it_finishes_later() -> None:
    s = make_scheduler(num_pages=1 + 8, chunk=64, budget=64, cache=False)  # 8 pages = 32 tokens
    old, new = make_req("old", 8, max_new=14), make_req("new", 8, max_new=14)
    s.add(old)
    step(s)
    s.add(new)
    for _ in range(40):
        step(s)
        if new.retractions:
            break
    assert new.retractions == 1 and old.retractions == 0 and new.status is Status.WAITING
    run_all(s)
    assert len(old.output_ids) == 14 and len(new.output_ids) == 14
    assert s.kv.allocator.available == s.kv.allocator.capacity


def test_max_running_requests_caps_the_batch() -> None:
    s = make_scheduler(max_running=2)
    for i in range(4):
        s.add(make_req(f"r{i}", 3))
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    s = make_scheduler(policy="lpm", chunk=64, budget=64, max_running=1)
    base = list(range(200, 220))
    first = make_req("first", base, max_new=1)
    s.add(first)
    run_all(s)
    s.add(make_req("cold", 20, max_new=1))
    warm = make_req("warm", base + [1, 2, 3], max_new=1)
    s.add(warm)
    batch = step(s)
    assert batch is not None and batch.seqs[0].req is warm and warm.cached_tokens == 20


def test_group_siblings_wait_for_the_leader_then_share_its_prompt_pages() -> None:
    s = make_scheduler(chunk=8, budget=64)
    leader = make_req("c0", 21)
    siblings = [make_req(f"c{i}", 21, leader=leader) for i in (1, 2)]
    for r in [leader, *siblings]:
        s.add(r)
    step(s)
    assert [r.status for r in siblings] == [Status.WAITING] * 2
    run_all(s)
    assert leader.cached_tokens == 0 and [r.cached_tokens for r in siblings] == [20, 20]


def test_abort_releases_pages_wherever_the_request_is() -> None:
    s = make_scheduler(chunk=4, budget=4)
    running, queued = make_req("running", 30), make_req("queued", 30)
    s.add(running), s.add(queued)
    step(s)
    assert s.abort("running", Abort(499, "gone")) is running and running.finish_reason == "abort"
    assert s.abort("queued", Abort(499, "gone")) is queued
    s.check_integrity()
    s.kv.cache.flush()
    assert s.kv.allocator.available == s.kv.allocator.capacity and not s.has_work
