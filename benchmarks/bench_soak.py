"""Soak: minutes of mixed load on a 1-prefill / 2-decode cluster behind the router, with a fault every phase.

Load: ``--clients`` threads send, back to back, a mix of greedy completions (streamed and not, one prompt or a
batch), chat with penalties and logit_bias, and invalid bodies (which must be a 4xx). Every greedy answer is
checked against the text the same request got before any fault, so a stream that ends early or an answer that
changed counts as lost or corrupted; a clean error status (or an SSE error event) counts as failed, by kind.

Faults, one per phase after a quiet first phase, in turn: SIGKILL a decode worker (restarted on its port
after 5 s), SIGSTOP a decode worker for 10 s, SIGKILL the prefill worker (restarted), and a burst of clients
that disconnect mid-stream. Per phase: requests, outcomes, p50/p99 latency of the good ones, and the RSS of
every process at the phase's end.

    python -m benchmarks.bench_soak [--minutes 10] [--phase-secs 60] [--clients 4] [--model tiny|smollm2]
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import Process, model_dir
from deploy.process import rss_bytes

FAULTS = ("kill_decode", "freeze_decode", "kill_prefill", "client_disconnects")
PROMPTS = ["The quick brown fox", "Once upon a time there was", "In the beginning", "A short poem about rain:"]


class Cluster:
    def __init__(self, model: str) -> None:
        self.model = model
        engine = ["--model-path", model, "--max-total-tokens", "16384"]
        self.engine = engine
        self.bport = Process.free_port()
        self.prefill = Process("prefill_worker", [*engine, "--bootstrap-port", str(self.bport)])
        self.decodes = [Process("decode_worker", engine) for _ in range(2)]
        for p in (self.prefill, *self.decodes):
            p.wait_ready("/health")
        self.router = Process("router.launch_router", [
            "--pd-disaggregation", "--prefill", self.prefill.url, str(self.bport),
            *(a for d in self.decodes for a in ("--decode", d.url)), "--health-check-interval-secs", "1",
            "--stall-timeout-secs", "5"])
        self.router.wait_ready("/readiness")

    def restart(self, old: Process) -> Process:
        new = Process(old.module, old.args, port=old.port)
        new.wait_ready("/health")
        return new

    def processes(self) -> dict[str, Process]:
        return {"router": self.router, "prefill": self.prefill, "decode-0": self.decodes[0],
                "decode-1": self.decodes[1]}

    def stop(self) -> None:
        for p in self.processes().values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.stop()


def request_mix(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    """(path, body, kind); kind 'greedy:*' answers are compared with their reference."""
    prompt = rng.choice(PROMPTS)
    r = rng.random()
    if r < 0.3:
        return "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}, "greedy:completion"
    if r < 0.55:
        return "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}, \
            "greedy:stream"
    if r < 0.7:
        return "/v1/completions", {"prompt": [prompt, PROMPTS[0]], "max_tokens": 12, "temperature": 0}, "greedy:batch"
    if r < 0.9:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                                        "temperature": 0.7, "seed": 1, "presence_penalty": 0.5,
                                        "logit_bias": {"5": -5}}, "sampled"
    return "/v1/completions", {"prompt": prompt, "max_tokens": -3}, "invalid"


def run_one(client: httpx.Client, url: str, path: str, body: dict) -> tuple[int, str, bool]:
    """(status, answer text, whether the stream ended with [DONE]); status 0: connection error, -1: an SSE error
    event after the 200."""
    try:
        if not body.get("stream"):
            r = client.post(url + path, json=body)
            if r.status_code != 200:
                return r.status_code, "", True
            data = r.json()
            return 200, "|".join(c.get("text") or c.get("message", {}).get("content", "") for c in data["choices"]), True
        text, done = "", False
        with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, "", True
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:  # the stream ended with an error event: a clean failure
                        return -1, "", True
                    text += "".join(c.get("text", "") for c in event.get("choices", []))
        return 200, text, done
    except httpx.HTTPError:
        return 0, "", False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--phase-secs", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    cluster = Cluster(str(model_dir(args.model)))
    url = cluster.router.url
    stop = threading.Event()
    lock = threading.Lock()
    phase = {"name": "warm-up"}
    log: list[dict] = []
    reference: dict[str, str] = {}
    with httpx.Client(timeout=60) as c:  # references, before any fault
        for i in range(40):
            path, body, kind = request_mix(random.Random(i))
            if kind.startswith("greedy"):
                status, text, _ = run_one(c, url, path, body)
                if status == 200:
                    reference.setdefault(json.dumps([path, body], sort_keys=True), text)

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                path, body, kind = request_mix(rng)
                t = time.monotonic()
                status, text, done = run_one(c, url, path, body)
                took = time.monotonic() - t
                if kind == "invalid":
                    outcome = "ok" if 400 <= status < 500 else f"invalid_got_{status}"
                elif status == 200 and not done:
                    outcome = "lost"
                elif status == 200 and kind.startswith("greedy"):
                    ref = reference.get(json.dumps([path, body], sort_keys=True))
                    outcome = "ok" if ref is None or ref == text else "corrupted"
                elif status == 200:
                    outcome = "ok"
                else:
                    outcome = {0: "failed_connection", -1: "failed_sse_event"}.get(status, f"failed_{status}")
                with lock:
                    log.append({"phase": phase["name"], "outcome": outcome, "seconds": took})

    def disconnects() -> None:
        for _ in range(20):
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=10,
                                  json={"prompt": "abandon me", "max_tokens": 200, "stream": True}) as r:
                    next(r.iter_lines(), None)  # one event, then hang up
            except httpx.HTTPError:
                pass

    def fault(name: str) -> None:
        if name == "kill_decode":
            cluster.decodes[0].proc.kill()
            cluster.decodes[0].proc.wait()
            time.sleep(5)
            cluster.decodes[0] = cluster.restart(cluster.decodes[0])
        elif name == "freeze_decode":
            cluster.decodes[1].proc.send_signal(signal.SIGSTOP)
            time.sleep(10)
            cluster.decodes[1].proc.send_signal(signal.SIGCONT)
        elif name == "kill_prefill":
            cluster.prefill.proc.kill()
            cluster.prefill.proc.wait()
            time.sleep(5)
            cluster.prefill = cluster.restart(cluster.prefill)
        else:
            disconnects()

    threads = [threading.Thread(target=client_loop, args=(s,), daemon=True) for s in range(args.clients)]
    for t in threads:
        t.start()
    rows = []
    phases = max(1, int(args.minutes * 60 / args.phase_secs))
    try:
        for n in range(phases):
            name = "quiet" if n == 0 else FAULTS[(n - 1) % len(FAULTS)]
            phase["name"] = f"{n}:{name}"
            started = time.monotonic()
            if n:
                time.sleep(args.phase_secs / 4)
                fault(name)
            time.sleep(max(0.0, args.phase_secs - (time.monotonic() - started)))
            with lock:
                mine = [e for e in log if e["phase"] == phase["name"]]
            good = sorted(e["seconds"] for e in mine if e["outcome"] == "ok")
            row = {"phase": phase["name"], "requests": len(mine), **Counter(e["outcome"] for e in mine),
                   "p50_s": round(statistics.median(good), 3) if good else None,
                   "p99_s": round(good[min(len(good) - 1, int(0.99 * len(good)))], 3) if good else None,
                   **{f"rss_{k}_mb": round(rss_bytes(p.proc.pid) / 2**20) for k, p in cluster.processes().items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        cluster.stop()
    totals = Counter(e["outcome"] for e in log)
    print(json.dumps({"total": len(log), **totals}))
    if args.output:
        args.output.write_text(json.dumps({"phases": rows, "totals": totals,
                                           "args": vars(args) | {"output": str(args.output)}}, indent=1))


if __name__ == "__main__":
    main()
