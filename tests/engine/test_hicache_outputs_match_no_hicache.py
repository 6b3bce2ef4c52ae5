"""With HiCache a prefix the device pool evicted comes back from the host tier: the same requests give the
same tokens as without it, their prompts report the loaded tokens as cached, and after everything (flush
included) both pools are idle and every page is accounted for."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfigError
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

TENANTS, SYSTEM, ROUNDS = 6, 64, 2
POOL = 256  # page 4: about three tenants' prompts; six tenants cycle it


def tenant_prompts() -> list[list[int]]:
    rng = random.Random(11)
    systems = [[rng.randrange(10, 4000) for _ in range(SYSTEM)] for _ in range(TENANTS)]
    return [systems[t] + [rng.randrange(10, 4000) for _ in range(6)] for _ in range(ROUNDS) for t in range(TENANTS)]


def run(model_dir: Path, hicache: CacheConfig | None, temperature: float = 0.0):
    core = make_core(model_dir, page_size=4, max_total_tokens=POOL, chunk=32, hicache=hicache)
    outputs, cached = [], []
    for i, prompt in enumerate(tenant_prompts()):
        req = core.make_request(prompt, SamplingParams(max_new_tokens=8, temperature=temperature, seed=7 + i,
                                                       ignore_eos=True), detokenize=False)
        core.run_to_completion([req])
        outputs.append(req.output_ids)
        cached.append(req.cached_tokens)
        core.check_integrity()
    stats = core.hicache.stats if core.hicache is not None else None
    core.flush_cache()
    core.check_integrity()
    assert core.allocator.available == core.allocator.capacity
    if core.hicache is not None:
        assert core.hicache.host.allocator.used == 0
    return outputs, cached, stats


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_evicted_prefixes_load_back_with_identical_outputs(tiny_model_dir: Path, policy: str,
                                                           temperature: float) -> None:
    plain, plain_cached, _ = run(tiny_model_dir, None, temperature)
    tiered, tiered_cached, stats = run(tiny_model_dir, CacheConfig(enable_hierarchical_cache=True,
                                                                   hicache_write_policy=policy), temperature)
    assert tiered == plain
    second = slice(TENANTS, None)
    assert sum(plain_cached[second]) == 0, "the workload must cycle the device pool"
    assert all(c == SYSTEM for c in tiered_cached[second]), tiered_cached  # each system prompt came back
    assert stats.loaded_tokens >= TENANTS * SYSTEM // 2 and stats.loaded_bytes > 0 and stats.written_bytes > 0
    assert len(stats.load_seconds) > 0


def test_hicache_flags_are_refused_without_it_or_out_of_range(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineConfigError, match="--hicache-ratio needs --enable-hierarchical-cache"):
        make_core(tiny_model_dir, hicache=CacheConfig(hicache_ratio=3.0))
    with pytest.raises(EngineConfigError, match="at least 1"):
        make_core(tiny_model_dir, hicache=CacheConfig(enable_hierarchical_cache=True, hicache_ratio=0.5))
    with pytest.raises(EngineConfigError, match="write_through_selective only"):
        make_core(tiny_model_dir, hicache=CacheConfig(enable_hierarchical_cache=True, hicache_write_threshold=3))
    with pytest.raises(EngineConfigError, match="drop --disable-radix-cache"):
        make_core(tiny_model_dir, disable_radix_cache=True, hicache=CacheConfig(enable_hierarchical_cache=True))
