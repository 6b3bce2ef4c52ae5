"""A load-back runs beside the engine where that overlaps the step (a CUDA device, or a CPU core torch leaves
free: set here as on such a host): a request whose prefix is being copied in from the host tier waits in the
queue while the requests behind it are admitted and decode, the engine thread sleeps between polls rather than
spinning when nothing else can run, and once the copy lands the request is admitted with the loaded prefix
counted as cached and gives the tokens a run without HiCache gives. A copy expected to be quick (or one that
could not overlap) is made in line: the request is admitted in the same step. A request aborted while its
prefix loads costs nothing: the load finishes, its pages go to the cache, and the pool empties on a flush. A
store read that hangs holds only its own request: others run to the end meanwhile, and after the store's
deadline the prefix is recomputed.

The copy is held back by a gate so the test sees the load in flight (the copy itself is the real one)."""
from __future__ import annotations

import random
import threading
from pathlib import Path

from engine.config import CacheConfig
from engine.engine_core import LOAD_POLL_S, EngineCore
from engine.request import Abort, Request
from engine.mem.storage import FileStore
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
    tier.overlap = True  # as on a host with a core to spare for the copy
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
    core.add_request(other)
    core.step()
    core.add_request(waiter)  # arrives while another request runs, its copy not timed yet: in the background
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


def test_a_quick_load_or_one_that_cannot_overlap_is_made_in_line(tiny_model_dir: Path) -> None:
    core, gate = core_with_prefix_in_l2(tiny_model_dir)
    gate.set()
    first = request(core, SECOND)
    core.add_request(first)
    drive(core, lambda: first.finished)  # the first copy ran in the background and was timed
    assert first.cached_tokens == SYSTEM and core.hicache.copy_seconds(SYSTEM // 4) < 1.0
    for overlap in (True, False):  # nothing running: quick enough; no overlap: in line whatever it costs
        core.cache.evict(core.cache.evictable_size)
        core.hicache.overlap = overlap
        blocker = request(core, OTHER)
        if not overlap:
            core.add_request(blocker)
            core.step()
        again = request(core, PREFIX + [31, 32])
        core.add_request(again)
        core.step()
        assert again in core.scheduler.running and again.cached_tokens == SYSTEM and not core.cache.loads_in_flight
        drive(core, lambda: again.finished and (overlap or blocker.finished))
        assert again.output_ids == alone(tiny_model_dir, PREFIX + [31, 32])
    core.check_integrity()


def test_a_store_read_that_hangs_holds_only_its_own_request(tiny_model_dir: Path, tmp_path: Path,
                                                             monkeypatch) -> None:  # noqa: ANN001 - pytest's
    def stored(timeout: float) -> EngineCore:
        return make_core(tiny_model_dir, page_size=4, max_total_tokens=256, hicache=CacheConfig(
            enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
            hicache_storage_timeout=timeout))
    writer = stored(2.0)
    writer.run_to_completion([request(writer, FIRST)])
    assert writer.hicache.writer.drain()
    writer.close()
    reader = stored(3.0)  # a fresh worker: the prefix is in the store only
    thaw = threading.Event()
    get = FileStore.get
    monkeypatch.setattr(FileStore, "get", lambda self, keys: (thaw.wait(30), get(self, keys))[1])  # frozen reads
    other = request(reader, OTHER)
    reader.add_request(other)
    reader.step()
    waiter = request(reader, SECOND)
    reader.add_request(waiter)
    drive(reader, lambda: other.finished)  # it decodes to the end while the waiter's read hangs
    assert waiter in reader.scheduler.waiting and reader.cache.loads_in_flight == 1
    drive(reader, lambda: waiter.finished)  # the read's deadline passes: the prefix is recomputed
    thaw.set()
    assert waiter.output_ids == alone(tiny_model_dir, SECOND) and other.output_ids == alone(tiny_model_dir, OTHER)
    assert reader.hicache.counters()["store_failures"] >= 1
    reader.cache.finish_loads(wait=True)
    reader.check_integrity()
    reader.close()


def test_a_copy_that_fails_costs_only_a_recomputation(tiny_model_dir: Path) -> None:
    core, gate = core_with_prefix_in_l2(tiny_model_dir)
    tier = core.hicache

    def broken(*args):  # noqa: ANN002, ANN202 - a bug in the copy, in line or on the loader thread
        raise RuntimeError("copy failed")
    tier.copy_in = broken
    for overlap in (False, True):
        tier.overlap = overlap
        req = request(core, SECOND)
        core.add_request(req)
        drive(core, lambda: req.finished)
        assert req.output_ids == alone(tiny_model_dir, SECOND) and req.cached_tokens == 0
        assert core.cache.loads_in_flight == 0
        core.check_integrity()
        core.cache.evict(core.cache.evictable_size)
        assert core.cache.match_prefix(SECOND).host_tokens >= SYSTEM, "the host tier still holds the prefix"
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity and tier.host.allocator.used == 0


def test_a_reservation_over_a_load_in_flight_waits_for_it(tiny_model_dir: Path) -> None:
    """The decode worker's path (``KVManager.match`` with ``load``): a match pending on another request's load
    waits for that load and then holds the whole prefix."""
    core, gate = core_with_prefix_in_l2(tiny_model_dir)
    other = request(core, OTHER)
    core.add_request(other)
    core.step()
    core.add_request(request(core, SECOND))
    core.step()
    assert core.cache.loads_in_flight == 1
    threading.Timer(0.2, gate.set).start()
    match = core.scheduler.kv.match(request(core, PREFIX + [41, 42]), load=True)
    assert match.num_tokens == SYSTEM and not match.pending and core.cache.loads_in_flight == 0
    drive(core, lambda: not core.has_work)
    core.check_integrity()
