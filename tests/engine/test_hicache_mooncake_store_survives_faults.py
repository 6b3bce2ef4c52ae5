"""HiCache's shared tier in a real Mooncake Store (a ``mooncake_master`` process; each engine a client giving it
memory): a second engine serves the first engine's prefixes from it with cold-run tokens; and a store that is
frozen (SIGSTOP), killed, restarted, full, unreachable at start-up, or holding a corrupt entry only costs
recomputation: every request succeeds with the same tokens, the deadline stops a frozen store from holding the
engine, the counters and ``store_state`` say what happened, and the store is used again once it answers."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfigError
from engine.engine_core import EngineCore
from tests.engine.conftest import make_core, run_each as run
from tests.helpers import MooncakeMaster, wait_until

pytest.importorskip("mooncake.store")
SYSTEM, TENANTS = 64, 3
Cores = Callable[[CacheConfig], EngineCore]


def prompts(seed: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(SYSTEM + 6)] for _ in range(TENANTS)]



def mooncake(master: MooncakeMaster, timeout: float = 2.0, **opts: object) -> CacheConfig:
    return CacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                       hicache_storage_backend_extra_config=master.extra_config(**opts),
                       hicache_storage_timeout=timeout)


@pytest.fixture
def cores(tiny_model_dir: Path) -> Iterator[Cores]:
    """Engines with a HiCache config; each closes its store client at the end (else it keeps dialling a dead
    master)."""
    made: list[EngineCore] = []

    def make(hicache: CacheConfig) -> EngineCore:
        made.append(make_core(tiny_model_dir, page_size=4, hicache=hicache))
        return made[-1]
    yield make
    with ThreadPoolExecutor(8) as pool:  # a Mooncake client takes about 2 s to leave
        list(pool.map(EngineCore.close, made))


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster().start()
    yield m
    m.kill()


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> dict[int, list[list[int]]]:
    core = make_core(tiny_model_dir, page_size=4)
    return {seed: run(core, prompts(seed))[0] for seed in range(4, 10)}


def test_a_second_engine_reads_what_the_first_stored(master: MooncakeMaster, cores: Cores,
                                                      cold: dict) -> None:
    first = cores(mooncake(master))
    assert first.hicache.describe()["storage_backend"] == "mooncake" and first.hicache.store_state() == "up"
    outs, cached = run(first, prompts())
    assert outs == cold[4] and cached == [0] * TENANTS and first.hicache.counters()["stored_tokens"] >= TENANTS * SYSTEM
    # another client of the store; a small local buffer: reads of 8 pages per call (the tiny model's pages are 16 KB)
    second = cores(mooncake(master, local_buffer_size="256kb"))
    outs, cached = run(second, prompts())
    assert outs == cold[4] and all(c >= SYSTEM for c in cached), cached
    assert second.hicache.stats.store_loaded_tokens == sum(cached)
    assert second.hicache.counters()["store_failures"] == 0


def test_a_frozen_then_killed_store_costs_recomputation_and_is_used_again(master: MooncakeMaster,
                                                                          cores: Cores,
                                                                          cold: dict) -> None:
    core = cores(mooncake(master, timeout=0.5))
    tier, store = core.hicache, core.hicache.store
    run(core, prompts(4))
    master.freeze()  # every client call now blocks 30 s (Mooncake's RPC timeout)
    try:
        outs, _ = run(core, prompts(5), drain=False)  # a write that met the freeze may still be stuck
        assert outs == cold[5]
        assert store.timeouts >= 1 and tier.counters()["store_failures"] >= 1 and store.state == "down"
        # no call queues behind the stuck one: at most one stuck per retry window, far fewer than calls made
        assert store.timeouts <= 3, store.timeouts
    finally:
        master.thaw()
    wait_until(lambda: run(core, prompts(6))[0] == cold[6] and store.state == "up", 30, 0.2, "the store back")
    written = tier.counters()["stored_tokens"]
    outs, _ = run(core, prompts(7))
    assert outs == cold[7] and tier.counters()["stored_tokens"] > written
    master.kill()  # metadata gone: lookups fail (or take seconds: the deadline cuts them)
    failures = tier.counters()["store_failures"]
    outs, cached = run(core, prompts(8))
    assert outs == cold[8] and cached == [0] * TENANTS and tier.counters()["store_failures"] > failures
    master.start()  # a new, empty master: the client mounts its segment again and writes resume
    written = tier.counters()["stored_tokens"]
    wait_until(lambda: run(core, prompts(9))[0] == cold[9] and tier.counters()["stored_tokens"] > written, 60, 0.3,
               "writes to the restarted store")
    core.check_integrity()


def test_a_full_store_and_a_corrupt_entry_cost_recomputation(master: MooncakeMaster, cores: Cores,
                                                             cold: dict) -> None:
    from mooncake.store import MooncakeDistributedStore
    rng = random.Random(1)
    long = [[rng.randrange(10, 4000) for _ in range(600)] for _ in range(8)]  # 19 MB of KV pages
    expected, _ = run(cores(CacheConfig()), long)
    small = cores(mooncake(master, global_segment_size="16mb"))
    outs, _ = run(small, long)  # the store (16 MB, evicting at 90%) fills up and refuses writes
    assert outs == expected and small.hicache.counters()["store_failures"] > 0 and small.hicache.store_state() == "up"
    outs, _ = run(cores(mooncake(master)), long)  # a reader of a
    assert outs == expected  # full store gets what is left of each prompt and recomputes the rest
    small.hicache.store.close()
    core = cores(mooncake(master))
    run(core, prompts(4))
    keys = core.hicache._keys(None, prompts(4)[0])
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address) == 0
    good = raw.get(keys[3])
    assert good and raw.upsert(keys[3], good[:-1] + bytes([good[-1] ^ 0xFF])) == 0  # one byte flipped
    reader = cores(mooncake(master))
    outs, cached = run(reader, prompts(4)[:1])
    assert outs == cold[4][:1] and cached == [12] and reader.hicache.stats.store_misses == 1  # 3 good pages
    # the recomputed page replaced the bad one (an overwrite: a recently read entry refuses removal). Its bytes
    # need not be the first write's: the recompute ran as a 58-row step, which may take another GEMM path than
    # the 70-row prefill did (the few-rows kernel or MKL, by the host's calibration). A fresh reader takes it.
    assert raw.get(keys[3]) != good[:-1] + bytes([good[-1] ^ 0xFF])
    raw.close()
    fresh = cores(mooncake(master))
    outs, cached = run(fresh, prompts(4)[:1])
    assert outs == cold[4][:1] and cached[0] > 12 and fresh.hicache.stats.store_misses == 0


def test_an_unreachable_store_at_start_up_is_used_once_it_answers(cores: Cores, cold: dict) -> None:
    master = MooncakeMaster()  # not started: nothing listens on its port
    core = cores(mooncake(master, timeout=0.5))
    store = core.hicache.store
    assert store.state == "down" and core.hicache.describe()["store_state"] == "down"
    outs, cached = run(core, prompts(4))
    assert outs == cold[4] and cached == [0] * TENANTS
    master.start()
    try:
        wait_until(lambda: run(core, prompts(5))[0] == cold[5] and core.hicache.counters()["stored_tokens"] > 0,
                   30, 0.2, "the store to come up")
        assert store.state == "up"
    finally:
        master.kill()


@pytest.mark.parametrize("extra, message", [
    (None, "needs --hicache-storage-backend-extra-config"),
    ("{not json", "is not JSON"),
    ('{"master_server_address": "127.0.0.1:1", "segment": 1}', "unknown key 'segment'"),
    ('{"metadata_server": "P2PHANDSHAKE"}', "master_server_address"),
    ('{"master_server_address": "127.0.0.1:1", "global_segment_size": "lots"}', "global_segment_size"),
    ("MASTER", "must be at least 16mb"),
    ('{"master_server_address": "127.0.0.1:x"}', "HOST:PORT"),
    ('{"master_server_address": "127.0.0.1:1", "protocol": 5}', "protocol must be a string"),
    ('{"master_server_address": "127.0.0.1:1", "local_buffer_size": "16kb"}', "under twice one page"),
])
def test_a_malformed_mooncake_setting_is_refused_naming_the_flag(master: MooncakeMaster, cores: Cores,
                                                                 extra: str | None, message: str) -> None:
    if extra == "MASTER":  # a master that answers and refuses the settings (a segment under 16 MB)
        extra = master.extra_config(global_segment_size="4mb")
    cfg = CacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                      hicache_storage_backend_extra_config=extra)
    with pytest.raises(EngineConfigError, match=message):
        cores(cfg)
