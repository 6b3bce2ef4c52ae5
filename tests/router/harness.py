"""Starting real router and worker processes on 127.0.0.1 for the router's tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import free_port, wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STARTUP_S = 20.0


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return int(self.popen.returncode)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class Worker(Proc):
    name: str = ""
    bootstrap_port: int | None = None

    def control(self, **kw: Any) -> None:
        httpx.post(f"{self.url}/_control", json=kw, timeout=5).raise_for_status()

    def release(self) -> None:
        httpx.post(f"{self.url}/_release", timeout=5).raise_for_status()

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/_state", timeout=5).json()

    def requests(self) -> list[dict[str, Any]]:
        return list(self.state()["requests"])


@dataclass
class Cluster:
    tmp: Path
    procs: list[Proc] = field(default_factory=list)

    def worker(self, role: str = "regular", name: str | None = None, bootstrap: bool = False,
               host: str = "127.0.0.1", port: int | None = None, bootstrap_port: int | None = None) -> Worker:
        port = port or free_port()
        bport = bootstrap_port or (free_port() if bootstrap else None)
        name = name or f"{role}-{port}"
        log = self.tmp / f"{name}.log"
        cmd = [sys.executable, str(HERE / "worker_process.py"), "--port", str(port), "--role", role, "--name", name,
               "--host", host]
        if bport:
            cmd += ["--bootstrap-port", str(bport)]
        p = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        w = Worker(p, f"http://{host}:{port}", log, name=name, bootstrap_port=bport)
        self.procs.append(w)
        wait_until(lambda: httpx.get(f"{w.url}/health", timeout=1).status_code == 200, STARTUP_S, what=f"worker {name}")
        return w

    def router(self, *args: str, ready: bool = True, env: dict[str, str] | None = None) -> Proc:
        port = free_port()
        log = self.tmp / f"router-{port}.log"
        cmd = [sys.executable, "-m", "router.launch_router", "--port", str(port),
               "--health-check-interval-secs", "0.2", "--log-level", "debug", *args]
        p = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, **(env or {})})
        r = Proc(p, f"http://127.0.0.1:{port}", log)
        self.procs.append(r)
        probe = "/readiness" if ready else "/health"

        def up() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"router exited with {p.returncode}:\n{r.logs()}")
            return httpx.get(r.url + probe, timeout=1).status_code == 200

        wait_until(up, STARTUP_S, what=f"router {probe}")
        return r

    def spawn(self, name: str, *cmd: str) -> Proc:
        """Any other helper process (e.g. the fake Kubernetes API server)."""
        log = self.tmp / f"{name}.log"
        p = subprocess.Popen([sys.executable, *cmd], stdout=log.open("wb"), stderr=subprocess.STDOUT)
        proc = Proc(p, "", log)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop(signal.SIGKILL if isinstance(p, Worker) else signal.SIGTERM, timeout=5)


def background_stream(url: str, body: dict[str, Any], timeout: float = 30) -> tuple[threading.Thread, dict[str, Any]]:
    """POSTs a streamed request from a thread; the dict gets `body` (text) or `error`."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=timeout) as resp:
                out["body"] = "".join(resp.iter_text())
        except httpx.HTTPError as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
