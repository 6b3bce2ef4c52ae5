"""HiCache load-back on a loader thread beside the engine vs in line on the engine thread, in one run: does
copying a prefix back from the host tier hold up the requests that are decoding meanwhile, and what does
waiting for it in the queue cost the request itself?

Workload (in-process, one EngineCore per variant, the variants interleaved trial by trial): ``--streams``
requests decode ``--output`` tokens each; every ``--every`` steps a tenant request arrives whose
``--system-tokens`` system prompt lives in the host tier only (computed at warm-up, then evicted from the
pool), plus a new 16-token question. Variants (``HostTier.overlap``, which the engine detects: see
``copies_overlap`` in engine/mem/hicache.py; the run prints what it detects here):

- ``background``: the request waits in the queue while the loader thread copies its prefix, and is admitted at
  the first step after the copy lands (every copy, even those the engine would make in line because they are
  expected to take under a quarter of a step);
- ``inline``: the copy on the engine thread, before the step that admits the request.

Reported per variant: the decoding streams' mean and p99 time between tokens, the tenants' mean TTFT (arrival
to first token), the wall time of the trial and the steps after which a load was still copying in the
background (0: every copy was made in line); ratios background / inline.

    python -m benchmarks.bench_hicache_overlap --model smollm2 --dtype float32
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, model_dir, table, write_json
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import LOAD_POLL_S, EngineCore
from engine.mem.hicache import copies_overlap
from engine.request import Request
from engine.sampling_params import SamplingParams

QUESTION = 16


def make_core(path: Path, dtype: str, pool: int, ratio: float, overlap: bool) -> EngineCore:
    core = EngineCore(EngineConfig(
        ModelConfig(model_path=str(path), dtype=dtype),
        CacheConfig(max_total_tokens=pool, page_size=16, enable_hierarchical_cache=True, hicache_ratio=ratio,
                    hicache_write_policy="write_through"),
        SchedulerConfig(chunked_prefill_size=512, max_prefill_tokens=4096)))
    assert core.hicache is not None
    core.hicache.overlap = overlap  # the variant, whatever this host would detect
    if overlap:
        core.hicache.copy_seconds = lambda pages: math.inf  # every copy on the loader thread, however quick
    return core


def trial(core: EngineCore, systems: list[list[int]], args: argparse.Namespace, rng: random.Random) -> dict:
    core.cache.evict(core.cache.evictable_size)  # every system prompt is in the host tier only now
    vocab = core.arch.vocab_size
    greedy = SamplingParams(max_new_tokens=args.output, temperature=0.0, ignore_eos=True)
    streams = [core.make_request([rng.randrange(10, vocab) for _ in range(64)], greedy, detokenize=False)
               for _ in range(args.streams)]
    for r in streams:
        core.add_request(r)
    while any(not r.output_ids for r in streams):  # the streams are decoding before the first tenant comes
        core.step()
    tenants: list[tuple[Request, float]] = []
    gaps: list[float] = []
    last = {r.rid: time.perf_counter() for r in streams}
    start, step, behind = time.perf_counter(), 0, 0
    while not all(r.finished for r in streams) or not all(t.finished for t, _ in tenants):
        if step % args.every == 0 and len(tenants) < len(systems):
            ids = systems[len(tenants)] + [rng.randrange(10, vocab) for _ in range(QUESTION)]
            t = core.make_request(ids, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
                                  detokenize=False)
            core.add_request(t)
            tenants.append((t, time.perf_counter()))
        counts = {r.rid: len(r.output_ids) for r in streams}
        core.step()
        behind += core.cache.loads_in_flight > 0  # a load still copying in the background after the step
        if core.scheduler.idle_on_loads:
            time.sleep(LOAD_POLL_S)
        now = time.perf_counter()
        for r in streams:
            if len(r.output_ids) > counts[r.rid]:
                gaps.append(now - last[r.rid])
                last[r.rid] = now
        step += 1
    wall = time.perf_counter() - start
    for t, _ in tenants:
        assert t.cached_tokens is not None and t.cached_tokens >= len(systems[0]) - 16, "a prefix did not load"
    gaps.sort()
    return {"itl_ms": 1e3 * statistics.fmean(gaps), "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
            "ttft_ms": 1e3 * statistics.fmean(t.first_token_time - arrived for t, arrived in tenants),
            "wall_s": wall, "load_steps": float(behind)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--output", type=int, default=96)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--every", type=int, default=12, help="steps between tenant arrivals")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hicache_overlap.json"))
    args = ap.parse_args()
    path = model_dir(args.model)
    pool = args.streams * (64 + args.output + 32) + 2 * (args.system_tokens + 64)
    ratio = max(2.0, 1.5 * args.tenants * (args.system_tokens + 64) / pool)  # the host tier holds every tenant
    variants = {"inline": make_core(path, args.dtype, pool, ratio, overlap=False),
                "background": make_core(path, args.dtype, pool, ratio, overlap=True)}
    print(f"this host's default: {'background' if copies_overlap(torch.device('cpu')) else 'inline'} "
          f"(torch threads {torch.get_num_threads()})", flush=True)
    rng = random.Random(0)
    vocab = variants["inline"].arch.vocab_size
    systems = [[rng.randrange(10, vocab) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    for core in variants.values():  # warm-up: every system prompt computed once, mirrored to the host tier
        for ids in systems:
            core.run_to_completion([core.make_request(ids + [11], SamplingParams(max_new_tokens=1),
                                                      detokenize=False)])
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for i in range(args.trials):
        for name, core in (variants.items() if i % 2 == 0 else reversed(variants.items())):
            runs[name].append(trial(core, systems, args, random.Random(100 + i)))
            print(name, {k: round(v, 2) for k, v in runs[name][-1].items()}, flush=True)
    rows: list[dict[str, Any]] = []
    for name, rs in runs.items():
        rows.append({"variant": name, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}})
    rows.append({"variant": "background / inline", **{k: rows[1][k] / rows[0][k] for k in rows[0] if k != "variant"
                                                      and k != "load_steps"}})
    print(table(rows, ["variant", "itl_ms", "itl_p99_ms", "ttft_ms", "wall_s", "load_steps"]))
    write_json(args.out, {"machine": machine(), "args": vars(args), "runs": runs, "rows": rows})


if __name__ == "__main__":
    main()
