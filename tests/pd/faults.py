"""Helpers for the PD failure tests: a request pair sent straight to a prefill and a decode worker (playing
the router's part), and waits on the workers' room metrics."""
from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.helpers import ServerProcess

LONG_PROMPT = [random.Random(1).randrange(10, 4000) for _ in range(3000)]  # ~1-2 s of prefill in 8-token chunks


@dataclass
class Call:
    """One HTTP call on a background thread; ``status`` is None if the connection failed."""
    url: str
    body: dict
    status: int | None = None
    body_out: dict = field(default_factory=dict)
    error: str | None = None
    elapsed: float | None = None
    thread: threading.Thread | None = None

    def start(self) -> Call:
        def run() -> None:
            t0 = time.monotonic()
            try:
                r = httpx.post(self.url + "/generate", json=self.body, timeout=120)
                self.status = r.status_code
                self.body_out = r.json()
            except httpx.HTTPError as e:
                self.error = type(e).__name__
            self.elapsed = time.monotonic() - t0
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def wait(self, timeout: float = 60) -> Call:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"call to {self.url} still running after {timeout}s"
        return self


def pair(prefill: ServerProcess, bport: int, decode: ServerProcess, room: int, ids: list[int],
         max_new_tokens: int = 4) -> tuple[Call, Call]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}
    return Call(prefill.url, body).start(), Call(decode.url, body).start()


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The value of one Prometheus sample, matched by name and labels (in any order); 0 if absent."""
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == labels:
            return float(m.group(3))
    return 0.0


def rooms(server: ServerProcess, role: str, state: str) -> float:
    return metric(server, "splitserve_kv_transfer_rooms", role=role, state=state)


def failures(server: ServerProcess, role: str, reason: str) -> float:
    return metric(server, "splitserve_kv_transfer_failures_total", role=role, reason=reason)


def serves(prefill: ServerProcess, bport: int, decode: ServerProcess, room: int) -> None:
    """A fresh request pair succeeds."""
    p, d = pair(prefill, bport, decode, room, list(range(10, 60)))
    d.wait(), p.wait()
    assert d.status == 200 and len(d.body_out["output_ids"]) == 4, (d.status, d.body_out, d.error)
    assert p.status == 200, (p.status, p.body_out)
