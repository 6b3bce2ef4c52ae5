"""Interleaved A/B of engine settings on the decode step, plus the CPU decode-attention kernel alone.

Single benchmark runs on a shared host move by 10-20%, more than most changes they are meant to judge. This
one builds one engine per variant in the same process, brings each to a full batch in decode (the same
prompts), then steps them alternately and reports each one's median decode step, so slow and fast phases of
the host fall on every variant alike. ``--kernel`` times the native decode kernel instead: its AVX-512 and
generic bodies (or, with ``--kernel-base REV``, this tree's kernel against REV's, alternating) on every layer's
pools (K/V from DRAM, pages scattered, and each sequence's pages in order) and on pages every sequence shares
(compute only). ``--gemm-base REV`` adds an engine of the first variant whose linear layers use REV's few-rows
GEMM (engine/models/few_rows_gemm.c, with the row counts it calibrates to on this host), stepped alternately with
the others; ``--gemm-base off``, one without that kernel (oneDNN's packed GEMM or MKL's take every row count).
``--attention-base REV`` does the same with REV's decode-attention kernel (engine/runner/attention/cpu_decode.c),
``--prefill-attention-base REV`` with REV's prefill-attention kernel (engine/runner/attention/cpu_prefill.c).
``--prefill`` times the prefill of ``--batch`` prompts of ``--context`` tokens (the server's chunk size and step
budget) instead of a decode step. ``--floor`` samples the host's read bandwidth (common.read_gbps) before every
FLOOR_ROUND steps and after the last, and reports each variant's steps against the weight-read floor (every matmul
weight read once: a batch-1 step's bound) at the better of the two samples around each round, median and range
over the rounds, and at the run's best sample: the host's bandwidth moves by up to 1.5x within minutes, so a floor
sampled minutes away from the steps measures the host as much as the engine.

    python -m benchmarks.bench_decode_ab --dtype bfloat16 --variant weight_prepack=off --variant weight_prepack=auto
    python -m benchmarks.bench_decode_ab --variant kv_cache_dtype=auto --variant kv_cache_dtype=bfloat16
    python -m benchmarks.bench_decode_ab --model smollm2 --batch 1 --variant dtype=bfloat16 --variant dtype=float32
    python -m benchmarks.bench_decode_ab --kernel
    python -m benchmarks.bench_decode_ab --kernel --kernel-shape smollm2 --context 544 --kernel-base HEAD~1
    python -m benchmarks.bench_decode_ab --model smollm2 --batch 1 --gemm-base HEAD~1
    python -m benchmarks.bench_decode_ab --model smollm2 --batch 1 --context 128 --steps 200 --floor
    python -m benchmarks.bench_decode_ab --model smollm2 --dtype bfloat16 --batch 1 --gemm-base off
    python -m benchmarks.bench_decode_ab --model smollm2 --batch 64 --context 512 --attention-base HEAD~1
    python -m benchmarks.bench_decode_ab --model smollm2 --prefill --batch 4 --context 512 --steps 8 \
        --variant weight_prepack=off --variant weight_prepack=auto
    python -m benchmarks.bench_decode_ab --model smollm2 --prefill --batch 4 --context 512 --steps 4 \
        --prefill-attention-base HEAD~1
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import DTYPES, prompts_for
from benchmarks.bench_vs_vllm import weight_read_floor_ms
from benchmarks.common import BENCH_MODELS, machine, model_dir, read_gbps, table, write_json
from engine import native
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.models import cpu_gemm
from engine.runner.attention import cpu_kernels
from engine.runner.attention.cpu_kernels import decode_attention, decode_kernel
from engine.sampling_params import SamplingParams


def parse_variant(text: str) -> dict[str, Any]:
    """``weight_prepack=on,kv_cache_dtype=bfloat16`` -> fields of ModelConfig / CacheConfig."""
    pairs = dict(p.split("=", 1) for p in text.split(",") if p)
    fields = {f.name: f for cls in (ModelConfig, CacheConfig) for f in dataclasses.fields(cls)}
    unknown = sorted(set(pairs) - set(fields))
    if unknown:
        raise SystemExit(f"unknown setting(s) {', '.join(unknown)}: use ModelConfig or CacheConfig field names")
    kinds = {name: type(fields[name].default) for name in pairs}
    return {k: (v.lower() in ("1", "true", "on") if kinds[k] is bool else kinds[k](v) if kinds[k] in (int, float)
                else v) for k, v in pairs.items()}


def engine(model: str, dtype: str, threads: int, tokens: int, variant: dict[str, Any],
           scheduler: SchedulerConfig) -> EngineCore:
    mc = {k: v for k, v in variant.items() if k in {f.name for f in dataclasses.fields(ModelConfig)}}
    cc = {k: v for k, v in variant.items() if k not in mc}
    return EngineCore(EngineConfig(
        ModelConfig(model_path=str(model_dir(model)), num_threads=threads, **{"dtype": dtype, **mc}),
        CacheConfig(max_total_tokens=tokens, disable_radix_cache=True, **cc), scheduler))


def decode_engine(model: str, dtype: str, threads: int, batch: int, context: int, steps: int,
                  variant: dict[str, Any]) -> EngineCore:
    """An engine with `batch` requests of `context` prompt tokens, stepped until all of them decode."""
    core = engine(model, dtype, threads, batch * (context + steps + 8) + 4096, variant,
                  SchedulerConfig(max_running_requests=batch, chunked_prefill_size=512, max_prefill_tokens=4096))
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(p, params, detokenize=False) for p in prompts_for(batch, context, 4000)]
    for r in reqs:
        core.add_request(r)
    while any(not r.output_ids for r in reqs):
        core.step()
    return core


def prefill_engine(model: str, dtype: str, threads: int, batch: int, context: int, steps: int,
                   variant: dict[str, Any]) -> EngineCore:
    """An engine with the server's scheduling defaults (chunk and step budget), warmed up by one prefill."""
    core = engine(model, dtype, threads, batch * (context + 8) + 4096, variant, SchedulerConfig())
    prefill(core, prompts_for(batch, context, 4000))
    return core


def prefill(core: EngineCore, prompts: list[list[int]]) -> None:
    """Steps until every prompt is prefilled (one output token each)."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    reqs = [core.make_request(p, params, detokenize=False) for p in prompts]
    for r in reqs:
        core.add_request(r)
    while any(not r.finished for r in reqs):
        core.step()


def run_ab(args: argparse.Namespace) -> list[dict[str, Any]]:
    variants = [parse_variant(v) for v in args.variant] or [{}]
    names = args.variant or ["default"]
    build = prefill_engine if args.prefill else decode_engine
    cores = [build(args.model, args.dtype, args.threads, args.batch, args.context, args.steps, v) for v in variants]
    for rev, module, attr, source, what in (
            (args.gemm_base, cpu_gemm, "few_rows_kernel", "engine/models/few_rows_gemm.c", "few-rows GEMM"),
            (args.attention_base, cpu_kernels, "decode_kernel", DECODE_SOURCE, "decode attention"),
            (args.prefill_attention_base, cpu_kernels, "prefill_kernel", PREFILL_SOURCE, "prefill attention")):
        if not rev:
            continue
        current = getattr(module, attr)
        base_lib = None if rev == "off" else source_at(rev, source, current())
        setattr(module, attr, lambda lib=base_lib: lib)  # the engine built now loads REV's kernel
        try:
            cores.append(build(args.model, args.dtype, args.threads, args.batch, args.context, args.steps,
                               variants[0]))
        finally:
            setattr(module, attr, current)
        names.append(f"{names[0]} without the {what} kernel" if base_lib is None
                     else f"{names[0]} with {rev}'s {what}")
    prompts = prompts_for(args.batch, args.context, 4000)
    times: list[list[float]] = [[] for _ in cores]
    reads: list[float] = []  # --floor: GB/s before each round of FLOOR_ROUND steps, and after the last
    for step in range(args.steps):
        if args.floor and step % FLOOR_ROUND == 0:
            reads.append(read_gbps(seconds=0.2))
        for i, core in enumerate(cores):
            start = time.perf_counter()
            if args.prefill:
                prefill(core, prompts)
            else:
                core.step()
            times[i].append(time.perf_counter() - start)
    if args.floor:
        reads.append(read_gbps(seconds=0.2))
    base = statistics.median(times[0])
    unit = "prefill" if args.prefill else "step"
    return [{"variant": names[i], f"median_{unit}_ms": 1e3 * statistics.median(t),
             f"p25_{unit}_ms": 1e3 * statistics.quantiles(t, n=4)[0],
             "tok_s": args.batch * (args.context if args.prefill else 1) / statistics.median(t),
             "speedup_vs_first": base / statistics.median(t),
             **(floor_columns(args, t, reads) if args.floor else {})} for i, t in enumerate(times)]


FLOOR_ROUND = 10  # --floor: steps a variant takes between two samples of the read bandwidth


def floor_columns(args: argparse.Namespace, times: list[float], reads: list[float]) -> dict[str, Any]:
    """A variant's steps against the weight-read floor: per round of FLOOR_ROUND steps, its median step over the
    floor at the better of the read samples just before and after the round (median and range over rounds), and
    its median step over the floor at the run's best sample."""
    floor_ms = lambda gbps: weight_read_floor_ms(args.model, args.dtype, gbps)["floor_ms"]  # noqa: E731
    rounds = [times[j:j + FLOOR_ROUND] for j in range(0, len(times), FLOOR_ROUND)]
    ratios = [1e3 * statistics.median(r) / floor_ms(max(reads[j], reads[j + 1])) for j, r in enumerate(rounds)]
    return {"over_floor_around": statistics.median(ratios), "over_floor_around_min": min(ratios),
            "over_floor_around_max": max(ratios), "read_gbps_median": statistics.median(reads),
            "over_floor_at_best_read": 1e3 * statistics.median(times) / floor_ms(max(reads))}


DECODE_SOURCE = "engine/runner/attention/cpu_decode.c"
PREFILL_SOURCE = "engine/runner/attention/cpu_prefill.c"


def source_at(rev: str, path: str, like: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """The native library of ``path`` (a C source of this repository) as it was at git revision ``rev``, compiled
    like the current one with the shared headers (engine/*.h) and those beside the source of ``rev``, for an A/B;
    its functions that ``like`` (the current library, already declared) also has get the same signatures."""
    source = Path(__file__).resolve().parent.parent / path
    engine_dir = Path(native.__file__).resolve().parent

    def show(file: Path) -> str:
        return subprocess.run(["git", "-C", str(file.parent), "show", f"{rev}:./{file.name}"], check=True,
                              capture_output=True, text=True).stdout

    def headers_at(folder: Path) -> dict[str, str]:
        names = subprocess.run(["git", "-C", str(folder), "ls-tree", "--name-only", rev, "./"], check=True,
                               capture_output=True, text=True).stdout.split()
        return {name: show(folder / name) for name in sorted(names) if name.endswith(".h")}

    text = show(source)
    headers = {**headers_at(engine_dir), **headers_at(source.parent)}
    with tempfile.TemporaryDirectory() as tmp:  # the compiled library lands in native's cache, not here
        copy = Path(tmp) / f"{source.stem}_{rev.replace('/', '_').replace('~', '_')}.c"
        for name, body in headers.items():  # `#include "x.h"` finds these, next to the copy, first
            (Path(tmp) / name).write_text(body)
        digest = hashlib.sha256("".join(headers.values()).encode()).hexdigest()[:16]
        copy.write_text(f"{text}\n/* {rev}'s headers: {digest} */\n")  # part of native's cache key
        lib = native.load(copy)
    if lib is None:
        raise SystemExit(f"no C compiler: {source.name} cannot be built")
    for name, now in (vars(like) if like is not None else {}).items():  # ctypes keeps the functions looked up
        if isinstance(now, ctypes._CFuncPtr) and hasattr(lib, name):  # older revisions may lack some
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = now.restype, now.argtypes
    return lib


def run_kernel(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per dtype pair: the AVX-512 and generic bodies (or, with ``--kernel-base REV``, this tree's AVX-512 body
    against REV's, alternating per sample) on pools bigger than the caches ("dram": every sequence's pages
    scattered at random, as a pool that has cycled holds them; "in order": each sequence's pages consecutive, as a
    fresh pool hands them out) and on pages every sequence shares ("hot")."""
    lib = decode_kernel()
    if lib is None:
        raise SystemExit("no C compiler: the native decode kernel is unavailable")
    if args.kernel_shape == "smollm2":
        heads, kv_heads, dim, layers = 9, 3, 64, 30
    else:  # the 150M model's attention
        heads, kv_heads, dim, layers = 12, 4, 64, 12
    page = args.page_size
    bodies = ({"this": (lib, False), args.kernel_base: (source_at(args.kernel_base, DECODE_SOURCE, lib), False)}
              if args.kernel_base else {"avx512": (lib, False), "generic": (lib, True)})
    pages_per_seq = -(-args.context // page)
    num_pages = args.batch * pages_per_seq + 1
    gen = torch.Generator().manual_seed(0)
    rows = []
    for q_dtype, kv_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                              (torch.bfloat16, torch.bfloat16)):
        pools = [(torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(kv_dtype),
                  torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(kv_dtype)) for _ in range(layers)]
        scattered = (torch.randperm(num_pages - 1, generator=gen)[: args.batch * pages_per_seq] + 1)
        tables = {"dram": scattered.reshape(args.batch, pages_per_seq),
                  "in order": torch.arange(1, args.batch * pages_per_seq + 1).reshape(args.batch, pages_per_seq),
                  "hot": scattered[:pages_per_seq].expand(args.batch, pages_per_seq).contiguous()}
        lens = torch.full((args.batch,), args.context, dtype=torch.int64)
        q = torch.randn(args.batch, heads, dim, generator=gen).to(q_dtype)
        kv_bytes = 2 * args.batch * args.context * kv_heads * dim * kv_dtype.itemsize
        row: dict[str, Any] = {"q/kv dtype": f"{q_dtype}/{kv_dtype}".replace("torch.", "")}
        for name, tab in tables.items():
            samples: dict[str, list[float]] = {body: [] for body in bodies}
            for _ in range(args.kernel_repeats):
                for body, (kernel, generic) in bodies.items():
                    start = time.perf_counter()
                    for k, v in pools:
                        decode_attention(kernel, q, k, v, tab, lens, page, dim ** -0.5, generic=generic)
                    samples[body].append((time.perf_counter() - start) / layers * 1e3)
            for body, times in samples.items():
                row[f"{body} {name} ms/layer"] = round(statistics.median(times), 3)
                if name != "hot":
                    row[f"{body} {name} GB/s"] = round(kv_bytes / statistics.median(times) / 1e6, 1)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="150m", choices=list(BENCH_MODELS))
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--variant", action="append", default=[],
                    help="comma-separated ModelConfig/CacheConfig settings, e.g. kv_cache_dtype=bfloat16 (repeat)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=40, help="decode steps (or --prefill: prefills) timed per variant")
    ap.add_argument("--prefill", action="store_true",
                    help="time the prefill of --batch prompts of --context tokens instead of a decode step (the "
                         "server's chunk size and step budget)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--floor", action="store_true",
                    help="report the steps against the weight-read floor at the read bandwidth sampled around each "
                         f"round of {FLOOR_ROUND} steps (decode only)")
    ap.add_argument("--kernel", action="store_true", help="time the decode-attention kernel alone instead")
    ap.add_argument("--kernel-base", default=None, metavar="REV",
                    help="--kernel: time this tree's kernel against the one at git revision REV, alternating")
    ap.add_argument("--kernel-shape", default="150m", choices=("150m", "smollm2"),
                    help="--kernel: the attention shapes and layer count timed")
    ap.add_argument("--gemm-base", default=None, metavar="REV",
                    help="also step an engine whose few-rows GEMM is REV's, or (off) one without it, alternating with "
                         "the others")
    ap.add_argument("--attention-base", default=None, metavar="REV",
                    help="also step an engine whose decode-attention kernel is REV's, or (off) one without it")
    ap.add_argument("--prefill-attention-base", default=None, metavar="REV",
                    help="also run an engine whose prefill-attention kernel is REV's, or (off) one without it (SDPA)")
    ap.add_argument("--kernel-repeats", type=int, default=5, help="--kernel: samples per body and table")
    ap.add_argument("--page-size", type=int, default=16, help="--kernel: tokens per page")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_ab.json"))
    args = ap.parse_args()
    if args.floor and (args.prefill or args.kernel):
        raise SystemExit("--floor times decode steps: not with --prefill or --kernel")
    torch.set_num_threads(args.threads)
    rows = run_kernel(args) if args.kernel else run_ab(args)
    print(table(rows, list(rows[0])))
    write_json(args.out, {"config": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
