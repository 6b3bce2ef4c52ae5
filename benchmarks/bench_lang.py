"""The frontend language against plain OpenAI calls, same server, same run: a tree-of-thought program (a shared
context, ``--forks`` branches per level, ``--levels`` levels, then a verdict) over ``--inputs`` problems, written
once with ``frontend`` (forks in parallel, token-exact continuations) and once as sequential
``chat.completions`` calls that resend the conversation each time. Reported: wall time and prompt tokens the
server computed (prompt minus cached, from its metrics). The plain calls run twice: against the same server, whose
radix cache serves their resent prefixes too, and against a second server that differs only in
``--disable-radix-cache``. Variants alternate per repeat.

    python -m benchmarks.bench_lang --inputs 16 --forks 4 --levels 2 --repeats 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import Process, machine, metric_total, model_dir, table, write_json
from frontend import Endpoint, function, gen

PROBLEM = ("A lighthouse keeper must ration {n} litres of oil over a stormy winter. Each clear night the lamp "
           "burns 2 litres, each stormy night 3, and supply boats come only when the sea is calm. ") * 6


@function
def tree(s, problem: str, forks: int, levels: int, max_tokens: int) -> None:  # noqa: ANN001
    with s.user():
        s += problem + " Think step by step."
    with s.assistant():
        s += "Let me consider some approaches."
        frontier = [s]
        for level in range(levels):
            nxt = []
            for parent in frontier:
                for i, f in enumerate(parent.fork(forks)):
                    f += f"\nApproach {level}.{i}:" + gen("thought", max_tokens=max_tokens, stop="\n")
                    nxt.append(f)
            frontier = nxt
        s += "\nBest: " + frontier[0]["thought"] + "\nVerdict:" + gen("verdict", max_tokens=max_tokens)


def plain_calls(url: str, model: str, problem: str, forks: int, levels: int, max_tokens: int) -> str:
    """The same program as sequential chat calls, each resending the conversation so far."""
    c = httpx.Client(base_url=url, timeout=600)

    def ask(history: str) -> str:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stop": ["\n"], "messages": [
            {"role": "user", "content": problem + " Think step by step.\n" + history}]}
        return c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    frontier = ["Let me consider some approaches."]
    for level in range(levels):
        frontier = [h + f"\nApproach {level}.{i}:" + ask(h + f"\nApproach {level}.{i}:")
                    for h in frontier for i in range(forks)]
    return ask(frontier[0] + "\nVerdict:")


def computed(url: str) -> float:
    return metric_total(url, "splitserve_prompt_tokens_total") - metric_total(url,
                                                                               "splitserve_cached_prompt_tokens_total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--forks", type=int, default=4)
    ap.add_argument("--levels", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=4, help="programs run at once by run_batch")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lang.json"))
    args = ap.parse_args()
    common = ["--model-path", str(model_dir(args.model)), "--max-total-tokens", "65536",
              "--max-running-requests", "128"]
    # the same server twice: as it ships, and without its prefix cache (what the seed's claim is measured
    # against: a runtime that recomputes every resent prefix)
    servers: dict[str, Process] = {}
    rows: dict[str, list[dict[str, float]]] = {"frontend": [], "plain OpenAI calls": [],
                                               "plain OpenAI calls, prefix cache off": []}
    try:
        servers["cache"] = Process("engine", common)
        servers["no cache"] = Process("engine", [*common, "--disable-radix-cache"])
        for srv in servers.values():
            srv.wait_ready("/health")
        ep = Endpoint(servers["cache"].url)
        problems = [{"problem": PROBLEM.format(n=100 + i), "forks": args.forks, "levels": args.levels,
                     "max_tokens": args.max_tokens} for i in range(args.inputs)]
        for _ in range(args.repeats):
            for name in rows:
                url = servers["no cache" if name.endswith("cache off") else "cache"].url
                httpx.post(url + "/flush_cache")
                before, start = computed(url), time.perf_counter()
                if name == "frontend":
                    tree.run_batch(problems, backend=ep, num_threads=args.threads)
                else:
                    for p in problems:
                        plain_calls(url, ep.model, p["problem"], args.forks, args.levels, args.max_tokens)
                rows[name].append({"wall_s": time.perf_counter() - start,
                                   "prompt_tokens_computed": computed(url) - before})
    finally:
        for srv in servers.values():
            srv.stop()
    out: list[dict[str, Any]] = [{"variant": name, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                                 for name, runs in rows.items()]
    for base in out[1:]:  # the frontend's ratios against each baseline, on the baseline's row
        base["frontend_speedup"] = base["wall_s"] / out[0]["wall_s"]
        base["frontend_fewer_prompt_tokens"] = (base["prompt_tokens_computed"]
                                                / max(1.0, out[0]["prompt_tokens_computed"]))
    print(table(out, ["variant", "wall_s", "prompt_tokens_computed", "frontend_speedup",
                      "frontend_fewer_prompt_tokens"]))
    write_json(args.out, {"machine": machine(), "args": vars(args) | {"out": str(args.out)}, "results": out,
                          "raw": rows})


if __name__ == "__main__":
    main()
