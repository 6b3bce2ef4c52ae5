"""Fixtures for engine tests: the built-in tiny model, cores sized for tests, and a shared colocated server."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, GrammarConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.engine_core import EngineCore
from engine.role import EngineRole
from engine.sampling_params import SamplingParams
from engine.spec import Drafter
from engine.tiny_model import ensure_tiny_model
from tests.helpers import ServerProcess


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def float32_rows_on_the_kernel() -> Iterator[None]:
    """Float32 layers give rows 1-64 to the few-rows kernel whatever this host's calibration says. It times the
    kernel against MKL once per host and kernel build, and the answer moves with the host's load (the same Zen 4
    host: 1-64 for one build, 1-31 for the next); a row's result does not depend on its batch only within the
    kernel's range, and a speculative step of 6 requests verifies up to 36 rows, so where MKL took them a seeded
    draw near a boundary came out differently than in plain decoding."""
    from engine.models import row_calibration
    measured = row_calibration.cached_rows

    def pinned(key: str, measure, file=None) -> frozenset[int]:  # noqa: ANN001 - row_calibration's signature
        rows = measured(key, measure, file)
        kernel = key.split("kernel=", 1)[-1].split(" ", 1)[0]
        return frozenset(range(1, 65)) if kernel.startswith("few_rows_gemm") and "bf16" not in kernel else rows
    with pytest.MonkeyPatch.context() as mp:  # module-wide, so a module's reference cores are pinned too
        mp.setattr(row_calibration, "cached_rows", pinned)
        yield


def make_core(model_dir: Path, *, page_size: int = 4, max_total_tokens: int = 8192, chunk: int = 512,
              max_prefill_tokens: int = 4096, disable_radix_cache: bool = False, max_running: int = 128,
              policy: str = "fcfs", eviction: str = "lru", dtype: str = "float32",
              stall_timeout: float = 30.0, role: EngineRole | None = None, jump_forward: bool = True,
              speculative: SpeculativeConfig = SpeculativeConfig(), drafter: Drafter | None = None,
              hicache: CacheConfig | None = None, decode_stack: str = "auto") -> EngineCore:
    """``hicache``: a CacheConfig whose HiCache fields are used (the pool's come from the arguments)."""
    return EngineCore(EngineConfig(
        ModelConfig(model_path=str(model_dir), dtype=dtype, decode_stack=decode_stack),
        dataclasses.replace(hicache or CacheConfig(), page_size=page_size, max_total_tokens=max_total_tokens,
                            disable_radix_cache=disable_radix_cache, radix_eviction_policy=eviction),
        SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=max_prefill_tokens,
                        max_running_requests=max_running, schedule_policy=policy,
                        stall_timeout_secs=stall_timeout),
        GrammarConfig(jump_forward=jump_forward), speculative),
        role=None if role is None else lambda _core: role, drafter=drafter)


def run_each(core: EngineCore, ids_list: list[list[int]], extra_key: str | None = None,
             max_new_tokens: int = 6, drain: bool = True) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and cached-token counts of each prompt run alone, then the integrity check and a cache
    flush after which the pool must be idle. ``drain``: wait for HiCache's store writes first (False where the
    store is frozen: a write caught by the freeze waits on the writer's thread, never the engine's)."""
    outs, cached = [], []
    for ids in ids_list:
        req = core.make_request(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                    ignore_eos=True), detokenize=False, extra_key=extra_key)
        core.run_to_completion([req])
        outs.append(req.output_ids)
        cached.append(req.cached_tokens)
    if drain and core.hicache is not None and core.hicache.writer is not None:
        assert core.hicache.writer.drain(), "store writes still queued after 10 s"  # deterministic tests
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity
    return outs, cached


@pytest.fixture(scope="session")
def tiny_core(tiny_model_dir: Path) -> EngineCore:
    return make_core(tiny_model_dir)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess("engine", ["--model-path", str(tiny_model_dir), "--max-total-tokens", "16384",
                                   "--page-size", "4", "--chunked-prefill-size", "64"]).wait_ready()
    yield srv
    srv.stop()
