"""Structured-output benchmark, engine level, one run (variants interleaved, repeats alternate):

1. Decode step at batch B with every row constrained by a JSON schema (the seeded schemas of the tests, so rows sit
   in different grammar states) against the same batch unconstrained: mean step time while all B rows decode, and
   the mask fill's own time per step (it runs on a helper thread beside the forward pass; that is what overlap
   hides). Jump-forward is off here so both variants compute one token per row per step.
2. Jump-forward on a schema with long fixed keys: output tokens per second at batch 1, on and off.
3. The first request with a new schema: compile time, and time to the first token uncached vs cached.
4. (``--serve``) A colocated server: 8 unconstrained streams measure inter-token latency while 100 requests
   arrive at once, each with a JSON schema no other request has (so every one compiles), against the same run
   with those 100 unconstrained. Compiling off the engine thread and filling masks beside the forward pass is
   what keeps the streams moving.

    python -m benchmarks.bench_grammar --model smollm2 --batch 64 --repeats 3 --serve
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, model_dir, table, write_json
from engine.config import CacheConfig, EngineConfig, GrammarConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.grammar.spec import GrammarSpec
from engine.request import Abort
from engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.schemas import random_schema  # noqa: E402 - the tests' seeded schemas, shared on purpose

LONG_KEYS = {"type": "object", "additionalProperties": False, "properties": {
    f"{name}_of_the_customer_account_record": {"type": "integer", "minimum": 0, "maximum": 9}
    for name in ("identifier", "loyalty_level", "region_code", "status_flag", "preferred_channel", "risk_score")},
    "required": [f"{name}_of_the_customer_account_record" for name in (
        "identifier", "loyalty_level", "region_code", "status_flag", "preferred_channel", "risk_score")]}


def make_core(path: Path, threads: int, batch: int, jump_forward: bool) -> EngineCore:
    return EngineCore(EngineConfig(
        ModelConfig(model_path=str(path), num_threads=threads),
        CacheConfig(max_total_tokens=batch * 1024 + 4096),
        SchedulerConfig(max_running_requests=batch, chunked_prefill_size=512, max_prefill_tokens=8192),
        GrammarConfig(jump_forward=jump_forward)))


def prompt(core: EngineCore, text: str) -> list[int]:
    return core.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def decode_steps(core: EngineCore, batch: int, constrained: bool, steps: int) -> dict[str, float]:
    """Mean step time over ``steps`` steps in which all rows decode, and the mask fill time per step."""
    ids = prompt(core, "Fill in a record about a shop as JSON.")
    reqs = []
    for i in range(batch):
        spec = GrammarSpec.from_json_schema(random_schema(100 + i % 20), "json_schema") if constrained else None
        sp = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=not constrained, grammar=spec)
        reqs.append(core.make_request(ids, sp, grammar=core.grammars.compile(spec).grammar if spec else None))
    for r in reqs:
        core.add_request(r)
    while not all(r.output_ids for r in reqs):  # prefill everything first
        core.step()
    times, fills = [], []
    for _ in range(steps):
        live = [r for r in reqs if not r.finished]
        if len(live) < batch:
            break
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        if constrained:
            mask = core.masks.start([r.grammar for r in reqs if not r.finished])
            fills.append(mask.result().seconds if mask is not None else 0.0)
    for r in reqs:
        if not r.finished:
            core.abort(r.rid, Abort(499, "benchmark done"))
    return {"step_ms": 1e3 * statistics.mean(times), "fill_ms": 1e3 * statistics.mean(fills) if fills else 0.0,
            "steps": len(times)}


def jump_run(core: EngineCore) -> dict[str, float]:
    spec = GrammarSpec.from_json_schema(LONG_KEYS, "json_schema")
    req = core.make_request(prompt(core, "Give the customer record as JSON."),
                            SamplingParams(max_new_tokens=400, temperature=0.0, grammar=spec),
                            grammar=core.grammars.compile(spec).grammar)
    start = time.perf_counter()
    steps = 0
    core.add_request(req)
    while not req.finished:
        core.step()
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens": len(req.output_ids), "steps": steps, "tok_per_s": len(req.output_ids) / seconds}


def first_request(core: EngineCore, schema: dict[str, Any]) -> dict[str, float]:
    spec = GrammarSpec.from_json_schema(schema, "json_schema")
    start = time.perf_counter()
    compiled = core.grammars.compile(spec)
    req = core.make_request(prompt(core, "A record as JSON."), SamplingParams(max_new_tokens=1, temperature=0.0,
                                                                              grammar=spec),
                            grammar=compiled.grammar)
    core.run_to_completion([req])
    return {"compile_ms": 1e3 * compiled.seconds, "ttft_ms": 1e3 * (time.perf_counter() - start),
            "hit": compiled.hit}


def _stream_gaps(url: str, body: dict) -> list[float]:
    import httpx
    gaps, last = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def serve_run(url: str, constrained: bool, round_id: int) -> dict[str, float]:
    """ITL of 8 probe streams while 100 background requests (distinct schemas, or none) run beside them."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    probe = {"model": "SmolLM2-135M-Instruct", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
             "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}]}

    def background(i: int) -> None:
        schema = {"type": "object", "properties": {f"field_{round_id}_{i}_{k}": {"type": "string", "maxLength": 12}
                                                   for k in range(3)}}
        body = {"model": probe["model"], "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": f"Record number {i} as JSON."}]}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"r{i}", "schema": schema}}
        httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()

    with ThreadPoolExecutor(116) as pool:
        probes = [pool.submit(_stream_gaps, url, probe) for _ in range(8)]
        time.sleep(1.0)  # the probes are decoding when the burst arrives
        burst = [pool.submit(background, i) for i in range(100)]
        gaps = [g for f in probes for g in f.result()]
        for f in burst:
            f.result()
    gaps.sort()
    return {"itl_mean_ms": 1e3 * statistics.mean(gaps), "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
            "itl_max_ms": 1e3 * gaps[-1]}


def serve_bench(path: Path, repeats: int) -> list[dict[str, Any]]:
    from benchmarks.common import Process
    server = Process("engine", ["--model-path", str(path), "--max-running-requests", "128",
                                "--max-total-tokens", "65536"])
    try:
        server.wait_ready("/health")
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for r in range(repeats):
            for constrained in (False, True):
                runs[constrained].append(serve_run(server.url, constrained, r))
    finally:
        server.stop()
    rows = [{"variant": f"100 background requests, {'each with its own new schema' if c else 'unconstrained'}",
             **{k: statistics.median(x[k] for x in runs[c]) for k in runs[c][0]}} for c in (False, True)]
    rows[1]["itl_vs_unconstrained"] = rows[1]["itl_mean_ms"] / rows[0]["itl_mean_ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="also run the server-level burst of distinct schemas")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/grammar.json"))
    args = ap.parse_args()
    path = model_dir(args.model)
    core = make_core(path, args.threads, args.batch, jump_forward=False)
    jump_core = make_core(path, args.threads, 1, jump_forward=True)
    rows: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": [], "jump on": [], "jump off": []}
    decode_steps(core, 4, True, 2)  # warm both paths
    for _ in range(args.repeats):
        rows["unconstrained"].append(decode_steps(core, args.batch, False, args.steps))
        rows["constrained"].append(decode_steps(core, args.batch, True, args.steps))
        rows["jump on"].append(jump_run(jump_core))
        rows["jump off"].append(jump_run(core))
    out = []
    for name in ("unconstrained", "constrained"):
        out.append({"variant": f"decode step, batch {args.batch}, {name}",
                    "step_ms": statistics.median(r["step_ms"] for r in rows[name]),
                    "fill_ms": statistics.median(r["fill_ms"] for r in rows[name])})
    base = out[0]["step_ms"]
    for r in out:
        r["vs_unconstrained"] = r["step_ms"] / base
    jumps = []
    for name in ("jump off", "jump on"):
        jumps.append({"variant": f"long fixed keys, batch 1, {name}",
                      "tok_per_s": statistics.median(r["tok_per_s"] for r in rows[name]),
                      "tokens": rows[name][0]["tokens"], "steps": rows[name][0]["steps"]})
    jumps[1]["speedup"] = jumps[1]["tok_per_s"] / jumps[0]["tok_per_s"]
    fresh = {"type": "object", "properties": {"bench_only_field": {"type": "string", "maxLength": 9}}}
    firsts = [{"variant": "new schema", **first_request(core, fresh)},
              {"variant": "same schema again", **first_request(core, fresh)}]
    print(table(out, ["variant", "step_ms", "fill_ms", "vs_unconstrained"]))
    print(table(jumps, ["variant", "tok_per_s", "tokens", "steps", "speedup"]))
    print(table(firsts, ["variant", "compile_ms", "ttft_ms", "hit"]))
    served = []
    if args.serve:
        del core, jump_core  # the server gets the cores to itself
        served = serve_bench(path, args.repeats)
        print(table(served, ["variant", "itl_mean_ms", "itl_p99_ms", "itl_max_ms", "itl_vs_unconstrained"]))
    write_json(args.out, {"machine": machine(), "model": args.model, "decode": out, "jump_forward": jumps,
                          "first_request": firsts, "served": served, "raw": rows})


if __name__ == "__main__":
    main()
