"""PD against colocated on the long-prompt interference workload, in one run, on the same cores.

Setups (one at a time, so each gets the whole machine): the colocated server with two torch threads, without
chunked prefill and with it; then a prefill worker and a decode worker with one thread each behind the router.
The workload (benchmarks/bench_serving.py, ``interference``): streamed short chats at a steady rate while
long prompts (4,000 tokens by default) arrive periodically. Reported: inter-token latency p50/p99 of the short
streams and time to first token of both kinds, with PD's ratios. Then a 4-turn chat through PD, with the
decode worker's radix cache on and off, for the KV bytes its prefix reuse saves.

    python -m benchmarks.bench_pd                       # tiny model, about 5 minutes here
    python -m benchmarks.bench_pd --model 150m --rate 0.5 --num-prompts 30
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_MODELS, Process, machine, metric_total, model_dir, table, write_json

THREADS = 2


@contextlib.contextmanager
def colocated(model: Path, chunk: int) -> Iterator[str]:
    with Process.group([("engine", ["--model-path", str(model), "--num-threads", str(THREADS),
                                    "--chunked-prefill-size", str(chunk)])]) as (srv,):
        yield srv.url


@contextlib.contextmanager
def disaggregated(model: Path, decode_args: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """A prefill and a decode worker (one thread each) behind the router; yields (router URL, decode URL)."""
    bport = Process.free_port()
    workers = [("prefill_worker", ["--model-path", str(model), "--num-threads", "1", "--bootstrap-port", str(bport)]),
               ("decode_worker", ["--model-path", str(model), "--num-threads", "1", *decode_args])]
    with Process.group(workers) as (prefill, decode):
        router = [("router.launch_router", ["--pd-disaggregation", "--prefill", prefill.url, str(bport),
                                            "--decode", decode.url])]
        with Process.group(router, ready_path="/readiness") as (r,):
            yield r.url, decode.url


def bench(url: str, label: str, args: argparse.Namespace, out_dir: Path, *extra: str) -> dict[str, Any]:
    out = out_dir / f"{label}.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--base-url", url, "--backend", "chat",
           "--request-rate", str(args.rate), "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
           "--max-duration", str(args.max_duration), "--label", label, "--output", str(out), "--no-plots",
           "--no-progress", *extra]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def interference(url: str, label: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    result = bench(url, label, args, out_dir, "--workload", "interference", "--input-len", "128",
                   "--output-len", "64", "--long-prompt-len", str(args.long_prompt_len), "--long-output-len", "8",
                   "--long-every", str(args.long_every))
    phase = result["phases"][0]
    short, long = phase["by_tag"]["short"], phase["by_tag"]["long"]
    return {"setup": label, "completed": phase["completed"], "failed": phase["failed"],
            "short_itl_p50_ms": short["itl_ms"]["p50"], "short_itl_p99_ms": short["itl_ms"]["p99"],
            "short_ttft_p50_ms": short["ttft_ms"]["p50"], "short_ttft_p99_ms": short["ttft_ms"]["p99"],
            "long_ttft_p50_ms": long["ttft_ms"]["p50"]}


def chat_bytes(model: Path, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """KV bytes the decode worker received for 4-turn chats, with and without its prefix cache."""
    sent = {}
    for label, extra in (("decode_reuse", ()), ("no_reuse", ("--disable-radix-cache",))):
        with disaggregated(model, extra) as (url, decode_url):
            before = metric_total(decode_url, "splitserve_kv_transfer_bytes_total")
            bench(url, f"chat-{label}", args, out_dir, "--workload", "multi-turn", "--num-turns", "4",
                  "--input-len", "64", "--output-len", "32", "--num-prompts", "8")
            sent[label] = metric_total(decode_url, "splitserve_kv_transfer_bytes_total") - before
    sent["saved_fraction"] = 1 - sent["decode_reuse"] / sent["no_reuse"] if sent["no_reuse"] else None
    return sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=list(BENCH_MODELS))
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s of the interference workload")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--long-prompt-len", type=int, default=4000)
    ap.add_argument("--long-every", type=int, default=8, help="every Nth request is a long prompt")
    ap.add_argument("--max-duration", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/pd.json"))
    args = ap.parse_args()
    model = model_dir(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        for label, chunk in (("colocated-unchunked", -1), ("colocated-chunked", 512)):
            with colocated(model, chunk) as url:
                rows.append(interference(url, label, args, out_dir))
        with disaggregated(model) as (url, _):
            rows.append(interference(url, "pd", args, out_dir))
        chat = chat_bytes(model, args, out_dir)
    pd, unchunked, chunked = rows[2], rows[0], rows[1]
    ratios = {"pd_itl_p99_vs_unchunked": pd["short_itl_p99_ms"] / unchunked["short_itl_p99_ms"],
              "pd_itl_p99_vs_chunked": pd["short_itl_p99_ms"] / chunked["short_itl_p99_ms"]}
    print(table(rows, list(rows[0])))
    print(f"PD short-stream ITL p99: {ratios['pd_itl_p99_vs_unchunked']:.2f}x the colocated server without "
          f"chunked prefill (goal <= 0.5x), {ratios['pd_itl_p99_vs_chunked']:.2f}x with it (goal <= 1x)")
    print(f"4-turn chats: decode received {chat['decode_reuse']:.0f} KV bytes with its prefix cache, "
          f"{chat['no_reuse']:.0f} without ({chat['saved_fraction']:.0%} saved)")
    write_json(args.out, {"config": vars(args), "machine": machine(), "runs": rows, "ratios": ratios,
                          "chat_transfer_bytes": chat})


if __name__ == "__main__":
    main()
