"""Interleaved A/B of the native row kernels (engine/models/row_ops.c: RMSNorm fused with the residual add, RoPE)
against the pure-torch path they replace, on whole target steps of one engine: the kernels are switched off by
making ``row_ops.usable`` answer None, so both variants share the model, the weights and the pool, and the
variants alternate round by round (a 2-core host's slow and fast phases fall on both). Each round times every
shape a few times over scratch pages (engine/spec/prior.time_step) and keeps the fastest; reported is the
median over rounds of each variant's time and of the paired ratio torch / native.

    python -m benchmarks.bench_row_ops_ab --model smollm2 --dtypes float32 bfloat16 --rounds 10
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import machine, model_dir, table, write_json
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.models import row_ops
from engine.spec.prior import time_step

REPO = Path(__file__).resolve().parent.parent
# (sequences, rows each): batch-1 decode, a batch-1 verification of 4 drafts, batch-16 decode, and a step of 512
# rows after 128 tokens of context, the size of a default prefill chunk (the kernels split rows over threads there)
SHAPES = [(1, 1), (1, 5), (16, 1), (1, 512)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/row-ops-ab.json"))
    args = ap.parse_args()
    native: Callable[..., Any] = row_ops.usable
    variants: dict[str, Callable[..., Any]] = {"torch": lambda *tensors: None, "native": native}
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        core = EngineCore(EngineConfig(ModelConfig(model_path=str(model_dir(args.model)), dtype=dtype,
                                                   num_threads=args.threads),
                                       CacheConfig(max_total_tokens=32768), SchedulerConfig(max_running_requests=16)))
        page = core.cfg.cache.page_size
        times: dict[tuple[str, tuple[int, int]], list[float]] = {(v, s): [] for v in variants for s in SHAPES}
        try:
            for rnd in range(args.rounds):
                order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
                for name in order:
                    row_ops.usable = variants[name]
                    for batch, each in SHAPES:
                        time_step(core.runner.forward, core.allocator, page, batch, each)  # warm
                        best = min(time_step(core.runner.forward, core.allocator, page, batch, each) or 0.0
                                   for _ in range(3))
                        times[(name, (batch, each))].append(best)
        finally:
            row_ops.usable = native
        for shape in SHAPES:
            a, b = times[("torch", shape)], times[("native", shape)]
            rows.append({"dtype": dtype, "sequences": shape[0], "rows_each": shape[1],
                         "torch_ms": round(1e3 * statistics.median(a), 2),
                         "native_ms": round(1e3 * statistics.median(b), 2),
                         "speedup": round(statistics.median(x / y for x, y in zip(a, b) if y > 0), 3)})
            print(table(rows[-1:], list(rows[-1])), flush=True)
        del core
    print(table(rows, list(rows[0])))
    write_json(Path(args.out), {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
