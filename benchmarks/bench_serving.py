"""bench_serving: load tests of an OpenAI-compatible (or /generate) endpoint, also run as ``splitserve bench``.

Seeded workloads (random lengths, shared-prefix tenants, multi-turn chat, long-prompt interference, a JSONL file)
sent at Poisson/constant/burst arrival rates or fixed concurrency, one phase per rate in a sweep. Each request is
streamed and timed (TTFT, ITL, TPOT, E2E); the target's /metrics are scraped around each phase. Writes a JSON
result (full configuration, versions, machine) and PNG plots; ``--compare`` puts earlier results side by side.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:30000 --workload shared-prefix \\
        --num-prompts 200 --request-rate 2 4 8 --slo-ttft-ms 500 --slo-tpot-ms 50
    python -m benchmarks.bench_serving --compare radix.json no-radix.json --compare-out radix-vs-none.png

Traffic goes only to --base-url (and the --metrics-url scrapes); every phase is bounded by --num-prompts and
--max-duration.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.serving.client import Client, RequestRecord
from benchmarks.serving.compare import run_compare
from benchmarks.serving.config import BenchConfig, ConfigError, build_parser, config_from_args
from benchmarks.serving.plots import write_plots
from benchmarks.serving.report import (build_result, by_tag_table, default_output, markdown_table, now_iso,
                                       write_json)
from benchmarks.serving.runner import PhaseRun, phase_name, run_phase
from benchmarks.serving.scrape import scrape, summarize
from benchmarks.serving.stats import SLO, summarize_phase
from benchmarks.serving.text import TextMaker, resolve_tokenizer
from benchmarks.serving.workloads import Item, Turn, build_items, describe

log = logging.getLogger("bench_serving")
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4


async def _discover(client: Client, cfg: BenchConfig) -> dict[str, Any]:
    """The target's self-description (what it offers of /v1/models, /get_server_info); absent parts are None."""
    info: dict[str, Any] = {"base_url": cfg.target.base_url, "backend": cfg.target.backend,
                            "model": cfg.target.model, "models": None, "server_info": None}
    for key, path in (("models", "/v1/models"), ("server_info", "/get_server_info")):
        try:
            info[key] = await client.get_json(path)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            info[key] = None
            log.debug("target has no usable %s: %s", path, e)
    if info["model"] is None and isinstance(info["models"], dict) and info["models"].get("data"):
        info["model"] = info["models"]["data"][0].get("id")
    return info


async def _warmup(client: Client, cfg: BenchConfig, tm: TextMaker) -> list[dict[str, Any]]:
    """Requests on text unrelated to the workload (so they warm nothing the workload could reuse)."""
    rng = random.Random(f"warmup-{cfg.workload.seed}")
    out = []
    for i in range(cfg.load.warmup_requests):
        item = Item(-1 - i, (Turn(tm.make(rng, WARMUP_PROMPT_LEN), WARMUP_OUTPUT_LEN, "warmup", WARMUP_PROMPT_LEN),))
        rec = RequestRecord(item.index, 0, "warmup", WARMUP_OUTPUT_LEN)
        await client.send(rec, client.payload(item, 0, []), time.perf_counter())
        out.append({"ok": rec.ok, "error": rec.error, "error_message": rec.error_message})
    return out


async def _flush(client: Client) -> str:
    try:
        await client.post_json("/flush_cache")
        return "flushed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return f"flush failed: {type(e).__name__}: {e}"


def _phase_json(run: PhaseRun, cfg: BenchConfig, slo: SLO, metrics: dict[str, Any] | None,
                flush: str | None) -> dict[str, Any]:
    arrival = cfg.load.arrival if math.isfinite(run.rate) else "all-at-once"
    phase = {"name": phase_name(run.rate, run.concurrency), "request_rate": run.rate,
             "max_concurrency": run.concurrency, "arrival": arrival,
             "hit_max_duration": run.hit_deadline, "cache_flush": flush,
             **summarize_phase(run.records, run.duration, slo), "server_metrics": metrics}
    if cfg.output.save_requests:
        phase["requests"] = [r.to_json() for r in run.records]
    return phase


async def run_benchmark(cfg: BenchConfig, argv: list[str]) -> tuple[dict[str, Any], Path]:
    started, t0 = now_iso(), time.perf_counter()
    choice = await asyncio.to_thread(resolve_tokenizer, cfg.target.tokenizer, cfg.target.base_url,
                                     cfg.target.auth_headers)
    tm = TextMaker(choice.tokenizer)
    items = build_items(cfg.workload, tm)
    slo = SLO(cfg.output.slo_ttft_ms, cfg.output.slo_tpot_ms, cfg.output.slo_e2e_ms)
    phases = []
    async with Client(cfg.target, cfg.target.model, tm) as client:
        target = await _discover(client, cfg)
        client.model = target["model"]
        target["warmup"] = await _warmup(client, cfg, tm)
        for w in target["warmup"]:
            if not w["ok"]:
                log.warning("a warmup request failed (%s: %s); it is recorded under target.warmup", w["error"],
                            w["error_message"])
        for rate, conc in cfg.load.phases():
            flush = await _flush(client) if cfg.target.flush_cache else None
            if flush not in (None, "flushed") and not phases:
                log.warning("%s (the target may not offer /flush_cache; --no-flush-cache silences this)", flush)
            before = await _scrape(cfg)
            run = await run_phase(client, items, rate, conc, cfg.load, cfg.workload.seed, cfg.output.progress)
            after = await _scrape(cfg)
            metrics = summarize(before, after, cfg.target.metrics_prefix) if before is not None else None
            phases.append(_phase_json(run, cfg, slo, metrics, flush))
    workload = {**describe(cfg.workload, items, tm), "tokenizer": choice.describe()}
    result = build_result(cfg, argv, target, workload, phases, started, time.perf_counter() - t0)
    out = Path(cfg.output.output) if cfg.output.output else default_output(cfg.label)
    return result, out


async def _scrape(cfg: BenchConfig) -> dict[str, Any] | None:
    if not cfg.target.scrape_metrics:
        return None
    return await asyncio.to_thread(scrape, cfg.target.metrics_urls, cfg.target.metrics_prefix,
                                   cfg.target.auth_headers)


def print_summary(result: dict[str, Any], out: Path) -> None:
    phases = result["phases"]
    print(f"\n## {result['label']}: {result['workload']['name']} against {result['target']['base_url']} "
          f"({result['target']['backend']})\n")
    print(markdown_table([(p["name"], p) for p in phases]))
    for p in phases:
        tags = by_tag_table(p)
        if tags:
            print(f"\n{p['name']} by tag:\n\n{tags}")
        if p["itl_coverage"] is not None and p["itl_coverage"] < 0.9:
            print(f"\n{p['name']}: only {p['itl_coverage']:.0%} of token gaps arrived as separate chunks, so ITL "
                  "is timed between chunks (TPOT is exact; --backend generate streams every token)")
        if p["failed"] or p["not_sent"]:
            print(f"\n{p['name']}: {p['failed']} failed {p['errors']}, {p['not_sent']} not sent; "
                  f"samples: {p['error_samples']}")
    print(f"\nresult: {out}")
    for plot in result["plots"]:
        print(f"plot: {plot}")


def main(argv: list[str] | None = None, prog: str = "bench_serving") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog=prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    try:
        cfg = config_from_args(args)
        if cfg.output.compare:
            text, plots = run_compare(cfg.output.compare, cfg.output.compare_out, cfg.output.plots)
            print(text)
            for p in plots:
                print(f"plot: {p}")
            return 0
        result, out = asyncio.run(run_benchmark(cfg, argv))
    except (ConfigError, FileNotFoundError) as e:
        parser.error(str(e))
    if cfg.output.plots:
        result["plots"] = [str(p) for p in write_plots([(result["label"], result)], out)]
    write_json(out, result)
    print_summary(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
