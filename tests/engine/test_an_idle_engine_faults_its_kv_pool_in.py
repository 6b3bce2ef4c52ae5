"""A fresh host KV pool is faulted in while the engine is idle (KVPool.prefault_next, MADV_POPULATE_WRITE), so
the first requests' steps do not pay for the page faults: the pool's pages become resident, whatever the pool
already held stays as it was, a request sent meanwhile is served as usual, and each piece is sized from the last
one's rate so that it takes about the same time however fast this host faults memory in."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.mem.kv_pool import (PREFAULT_MAX_BYTES, PREFAULT_MIN_BYTES, KVPool, KVShape,
                                 prefault_piece_bytes)
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")


def rss_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Rss line")


def test_prefaulting_makes_the_pool_resident_and_keeps_its_contents() -> None:
    pool = KVPool(KVShape(num_layers=8, num_pages=1024, page_size=16, num_kv_heads=2, head_dim=64,
                          dtype=torch.float32), torch.device("cpu"))  # 128 MiB
    pool.data[3, 1, 5000] = 7.0
    pool.data[7, 0, -1] = -2.0
    before = rss_bytes()
    assert pool.prefaulted_ratio == 0.0
    chunks = 0
    while pool.prefault_pending:
        pool.prefault_next()
        chunks += 1
    assert chunks >= 128 * 2**20 // PREFAULT_MAX_BYTES + 1  # in bounded pieces (the first a small probe)
    assert rss_bytes() - before > 100 * 2**20
    assert pool.prefaulted_ratio == 1.0
    assert (pool.data[3, 1, 5000] == 7.0).all() and (pool.data[7, 0, -1] == -2.0).all()
    assert pool.data[:, :, :16].abs().sum() == 0  # the null page is still zeros


def test_a_piece_is_sized_from_the_last_ones_rate() -> None:
    budget = 0.004
    fast = prefault_piece_bytes(8 << 20, 0.002, budget)  # 4 GB/s: 16 MiB in the budget
    slow = prefault_piece_bytes(8 << 20, 0.050, budget)  # a VM's untouched memory: 160 MB/s, ~0.6 MiB
    assert fast == 16 << 20
    assert PREFAULT_MIN_BYTES <= slow < 1 << 20 and slow % 4096 == 0
    assert prefault_piece_bytes(8 << 20, 0.0, budget) == PREFAULT_MAX_BYTES  # bounded above
    assert prefault_piece_bytes(4096, 1.0, budget) == PREFAULT_MIN_BYTES  # and below: progress however slow


def test_the_engine_faults_its_pool_in_while_idle_and_still_serves(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, max_total_tokens=200_000)
    assert core.pool.prefault_pending

    async def run() -> list[int]:
        engine = AsyncEngine(core)
        engine.start()
        try:
            req = core.make_request([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.0))
            async for _ in engine.generate([req]):
                pass
            for _ in range(500):
                if not await engine.call(lambda c: c.pool.prefault_pending):
                    break
                await asyncio.sleep(0.01)
            return req.output_ids
        finally:
            await engine.shutdown()

    assert len(asyncio.run(run())) == 4
    assert not core.pool.prefault_pending
