"""A load-back runs beside the engine: a request whose prefix is being copied in from the host tier waits in
the queue while the requests behind it are admitted and decode, the engine thread sleeps between polls rather
than spinning when nothing else can run, and once the copy lands the request is admitted with the loaded
prefix counted as cached and gives the tokens a run without HiCache gives. A request aborted while its prefix
loads costs nothing: the load finishes, its pages go to the cache, and the pool empties on a flush.

The copy is held back by a gate so the test sees the load in flight (the copy itself is the real one)."""
from __future__ import annotations

import random
import threading
from pathlib import Path

from engine.config import CacheConfig
from engine.engine_core import LOAD_POLL_S, EngineCore
from engine.request import Abort, Request
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

SYSTEM = 64
rng = random.Random(3)
PREFIX = [rng.randrange(10, 4000) for _ in range(SYSTEM)]
FIRST, SECOND = PREFIX + [11, 12, 13], PREFIX + [21, 22, 23, 24, 25]
OTHER = [rng.randrange(10, 4000) for _ in range(40)]


def core_with_prefix_in_l2(model_dir: Path) -> tuple[EngineCore, threading.Event]:
    core = make_core(model_dir, page_size=4, max_total_tokens=256,
                     hicache=CacheConfig(enable_hierarchical_cache=True, hicache_write_policy="write_back"))
    core.run_to_completion([request(core, FIRST)])
    core.cache.evict(core.cache.evictable_size)  # demoted: the prefix lives in the host tier only
    assert core.cache.match_prefix(SECOND).host_tokens == SYSTEM
    tier, gate = core.hicache, threading.Event()
    copy_in = tier.copy_in

    def gated(*args):  # noqa: ANN002, ANN202
        assert gate.wait(30), "the test never opened the gate"
        return copy_in(*args)
    tier.copy_in = gated
    return core, gate


def request(core: EngineCore, ids: list[int]) -> Request:
    return core.make_request(ids, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                             detokenize=False)


def drive(core: EngineCore, until, steps: int = 2000) -> None:  # noqa: ANN001 - a predicate
    for _ in range(steps):
        if until():
            return
        core.step()
        if core.scheduler.idle_on_loads:
            threading.Event().wait(LOAD_POLL_S)
    raise AssertionError("the engine did not get there")


def alone(model_dir: Path, ids: list[int]) -> list[int]:
    core = make_core(model_dir, page_size=4, max_total_tokens=256)
    req = request(core, ids)
    core.run_to_completion([req])
    return req.output_ids


def test_a_request_waits_in_the_queue_while_its_prefix_loads_and_others_run(tiny_model_dir: Path) -> None:
    core, gate = core_with_prefix_in_l2(tiny_model_dir)
    waiter, other = request(core, SECOND), request(core, OTHER)
    core.add_request(waiter)
    core.add_request(other)
    for _ in range(4):  # the other request is admitted and decodes; the waiter stays queued
        core.step()
        assert waiter in core.scheduler.waiting and waiter not in core.scheduler.running
        assert core.cache.loads_in_flight == 1 and core.cache.match_prefix(SECOND).pending
        core.check_integrity()  # the load's pages are its own, counted once
    assert other.output_ids and core.idle_wait() == 0.0
    drive(core, lambda: other.finished)
    core.step()
    assert core.scheduler.idle_on_loads and core.idle_wait() == LOAD_POLL_S, "nothing to compute: it polls"
    gate.set()
    drive(core, lambda: waiter.finished)
    assert waiter.cached_tokens == SYSTEM and waiter.prefix_loads == 1
    assert core.hicache.stats.loaded_tokens == SYSTEM and len(core.hicache.stats.load_seconds) == 1
    assert waiter.output_ids == alone(tiny_model_dir, SECOND)
    assert other.output_ids == alone(tiny_model_dir, OTHER)
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity and core.hicache.host.allocator.used == 0


def test_a_request_aborted_while_its_prefix_loads_leaves_the_pool_idle(tiny_model_dir: Path) -> None:
    core, gate = core_with_prefix_in_l2(tiny_model_dir)
    waiter = request(core, SECOND)
    core.add_request(waiter)
    core.step()
    assert core.cache.loads_in_flight == 1 and core.abort(waiter.rid, Abort(499, "client went away")) is not None
    assert core.has_work, "a load in flight keeps the engine stepping until the tree takes its pages"
    gate.set()
    drive(core, lambda: not core.has_work)
    assert core.cache.loads_in_flight == 0 and core.cache.match_prefix(SECOND).num_tokens == SYSTEM
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity and core.hicache.host.allocator.used == 0
