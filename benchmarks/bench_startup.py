"""Start-up benchmark: how long ``python -m engine`` takes until ``/health`` answers 200, and its resident memory
once ready and after one request, for the default model (SmolLM2-135M-Instruct from its GGUF) with a cold cache
(its config and tokenizer converted in this start) and a warm one, and for the built-in tiny model. Variants run
interleaved, ``--repeats`` times each, on the same KV budget (``--max-total-tokens``); the median is reported.

    python -m benchmarks.bench_startup --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import Process, machine, table, write_json
from deploy.process import rss_bytes
from engine.tiny_model import default_cache_dir


def rss_mb(pid: int) -> float:
    return rss_bytes(pid) / 2**20


def start_once(model: str, dtype: str, cache: Path, tokens: int) -> dict[str, Any]:
    args = ["--dtype", dtype, "--max-total-tokens", str(tokens)] + ([] if model == "default" else ["--model-path", model])
    t0 = time.perf_counter()
    srv = Process("engine", args, env={"SPLITSERVE_CACHE": str(cache)})
    try:
        srv.wait_ready("/health")
        ready_s = time.perf_counter() - t0
        ready_rss = rss_mb(srv.proc.pid)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0})
        r.raise_for_status()
        return {"ready_s": ready_s, "rss_ready_mb": ready_rss, "rss_after_request_mb": rss_mb(srv.proc.pid),
                "answer": r.json()["choices"][0]["message"]["content"]}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/startup.json"))
    args = ap.parse_args()
    warm_cache = default_cache_dir()
    variants = [("default", dtype, "cold") for dtype in args.dtypes] + \
               [("default", dtype, "cached") for dtype in args.dtypes] + [("tiny", "float32", "cached")]
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {v: [] for v in variants}
    start_once("default", "float32", warm_cache, 4096)  # fill the warm cache (and the OS page cache) first
    for _ in range(args.repeats):
        for v in variants:
            model, dtype, cache = v
            with tempfile.TemporaryDirectory(prefix="splitserve-cold-") as cold:
                runs[v].append(start_once(model, dtype, Path(cold) if cache == "cold" else warm_cache,
                                          args.max_total_tokens))
            print(v, {k: round(x, 2) if isinstance(x, float) else x for k, x in runs[v][-1].items()})
    rows = [{"model": "SmolLM2-135M-Instruct (GGUF Q4_1)" if m == "default" else "tiny", "dtype": d, "cache": c,
             **{k: statistics.median(r[k] for r in runs[(m, d, c)])
                for k in ("ready_s", "rss_ready_mb", "rss_after_request_mb")},
             "answer": runs[(m, d, c)][-1]["answer"]} for (m, d, c) in variants]
    print(table(rows, ["model", "dtype", "cache", "ready_s", "rss_ready_mb", "rss_after_request_mb", "answer"]))
    write_json(args.out, {"config": vars(args), "machine": machine(), "rows": rows,
                          "runs": {"/".join(k): v for k, v in runs.items()}})


if __name__ == "__main__":
    main()
