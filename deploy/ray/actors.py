"""ServerActor: one SplitServe process (the router, a prefill or a decode worker) run by a Ray actor on the node
Ray placed it on. The process cannot outlive the actor (deploy.process), and the actor does not outlive the
process: when the process dies the actor exits too, so Ray restarts both (``max_restarts``)."""
from __future__ import annotations

import os
import sys
import threading
import time

from deploy import probe
from deploy.commands import Endpoint, decode_argv, prefill_argv, router_argv, url
from deploy.process import LogPump, describe_exit, free_ports, spawn, stop_group



class ServerActor:
    def __init__(self, name: str, role: str, model_path: str | None, extra: list[str], port: int = 0,
                 host: str | None = None, workers: list[dict] | None = None,
                 secrets: dict[str, str] | None = None) -> None:
        """``secrets`` go into the process's environment (never its command line)."""
        import ray  # only inside Ray workers

        self.name, self.role = name, role
        self.node_ip = ray.util.get_node_ip_address()
        host = host or self.node_ip
        advertised = self.node_ip if host == "0.0.0.0" else host
        self.bootstrap_port: int | None = None
        if role == "router":
            self.port = port or free_ports(1, host)[0]
            argv = router_argv(host=host, port=self.port, workers=[Endpoint(**w) for w in workers or []], extra=extra)
        elif role == "prefill":
            self.port, self.bootstrap_port = free_ports(2, host)
            argv = prefill_argv(host=host, port=self.port, bootstrap_port=self.bootstrap_port, model_path=model_path,
                                extra=extra)
        elif role == "decode":
            self.port = free_ports(1, host)[0]
            argv = decode_argv(host=host, port=self.port, model_path=model_path, extra=extra)
        else:
            raise ValueError(f"unknown role {role!r}")
        self.url = url(advertised, self.port)
        self.healthy = False
        self.stopping = False
        self.proc = spawn(argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **(secrets or {})})
        assert self.proc.stdout is not None
        self.pump = LogPump(self.proc.stdout, [self._print])
        self.started = time.time()
        print(f"started pid {self.proc.pid}: {' '.join(argv)}", flush=True)
        threading.Thread(target=self._watch, daemon=True, name="watch").start()
        threading.Thread(target=self._probe, daemon=True, name="probe").start()

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return self.name

    @staticmethod
    def _print(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def _watch(self) -> None:
        code = self.proc.wait()
        if self.stopping:
            return
        self.pump.join(2.0)
        tail = "\n".join(f"    {ln}" for ln in self.pump.tail(30))
        print(f"{self.name}: process {self.proc.pid} {describe_exit(code)}; last lines:\n{tail}\n"
              f"{self.name}: exiting so that Ray restarts this actor", flush=True)
        os._exit(1)

    def _probe(self) -> None:
        while not self.stopping and self.proc.poll() is None:
            self.healthy = probe.status(self.url + "/health", timeout=2.0) == 200
            time.sleep(1.0)

    def info(self) -> dict:
        return {"name": self.name, "role": self.role, "url": self.url, "bootstrap_port": self.bootstrap_port,
                "node_ip": self.node_ip, "pid": self.proc.pid, "actor_pid": os.getpid(), "healthy": self.healthy,
                "started": self.started}

    def stop(self, timeout: float) -> int:
        """Graceful: SIGTERM (in-flight requests finish), SIGKILL after ``timeout`` s."""
        self.stopping = True
        return stop_group(self.proc, timeout)
