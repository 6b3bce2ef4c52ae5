"""The CPU prefill-attention kernel (engine/runner/attention/cpu_prefill.c) alone: this tree's against the one at
git revision ``--base``, alternating sample by sample in one process, on one prefill step's attention.

Shape: ``--seqs`` sequences of ``--len`` new tokens each (no cached prefix, causal), SmolLM2's heads (9 query, 3
kv, dim 64) by default, pages of ``--page-size`` scattered at random through the pool. Each sample times
``--layers`` calls (one per layer); reported is each kernel's best sample per layer, its rate (the causal
QK and PV multiply-adds, 4 FLOP per query-key pair and dim), and the largest difference between their outputs.

    python -m benchmarks.bench_prefill_kernel --base HEAD~1
    python -m benchmarks.bench_prefill_kernel --base HEAD~1 --dtypes bfloat16 --seqs 1 --len 2048
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_decode_ab import source_at
from benchmarks.common import machine, table, write_json
from engine.runner.attention.cpu_kernels import prefill_attention, prefill_kernel


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    now = prefill_kernel()
    if now is None:
        raise SystemExit("no C compiler: the native prefill kernel is unavailable")
    kernels = {"this tree": now, args.base: source_at(args.base, "engine/runner/attention/cpu_prefill.c", now)}
    s, t, p = args.seqs, args.len, args.page_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        q = torch.randn(s * t, args.heads, args.dim, generator=gen).to(dtype)
        pages = -(-t // p)
        k_cache = torch.randn(s * pages * p, args.kv_heads, args.dim, generator=gen).to(dtype)
        v_cache = torch.randn(s * pages * p, args.kv_heads, args.dim, generator=gen).to(dtype)
        table_ = torch.randperm(s * pages, generator=gen).view(s, pages).contiguous()
        starts, lens = torch.arange(s) * t, torch.full((s,), t)
        outs = {k: torch.empty_like(q) for k in kernels}
        best = {k: float("inf") for k in kernels}
        for _ in range(args.repeats):
            for key, lib in kernels.items():
                start = time.perf_counter()
                for _ in range(args.layers):
                    prefill_attention(lib, q, k_cache, v_cache, outs[key], starts, lens, lens, table_, p,
                                      args.dim ** -0.5)
                best[key] = min(best[key], (time.perf_counter() - start) / args.layers)
        flops = s * args.heads * t * (t + 1) / 2 * args.dim * 4
        row: dict[str, Any] = {"dtype": name}
        for key in kernels:
            row[f"{key} ms/layer"] = round(best[key] * 1e3, 3)
            row[f"{key} GFLOP/s"] = round(flops / best[key] / 1e9)
        row["speedup"] = round(best[args.base] / best["this tree"], 3)
        row["max |diff|"] = f"{float((outs['this tree'].float() - outs[args.base].float()).abs().max()):.1e}"
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, metavar="REV", help="git revision whose kernel is compared")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=512, help="new tokens per sequence")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=10, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=7, help="samples per kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_kernel.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args)
    print(table(rows, list(rows[0])))
    write_json(args.out, {"config": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
