"""``python -m deploy.ray.launch --address auto --prefill N --decode M --model-path DIR``

Joins a Ray cluster, reserves one placement group for the workers (one bundle per worker: ``num_cpus`` and the
role's ``num_gpus``; PACK or SPREAD), starts the prefill and decode workers as named actors in it, then the router
as an actor on this node, and prints the router URL. Ray restarts an actor whose process died (``max_restarts``);
a restarted worker comes back on new ports, and this launcher keeps the router's worker list in step (``POST`` and
``DELETE /workers``). SIGINT or SIGTERM stops every process gracefully, kills the actors and removes the placement
group; if the launcher itself dies, Ray ends its actors (they belong to this driver) and their processes follow."""
from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from deploy import probe
from deploy.banner import ready_banner
from deploy.commands import Endpoint, split_args
from deploy.ray.config import RayLaunchConfig, RayLaunchError, parse_config
from engine.config import API_KEY_ENV as WORKER_KEY_ENV
from kv_transfer.auth import TOKEN_ENV
from router.config import WORKER_API_KEY_ENV


def log(text: str) -> None:
    for line in text.splitlines():
        print(f"[ray-launch] {line}", flush=True)


@dataclass
class Tracked:
    """What the launcher knows of one actor."""
    name: str
    role: str
    handle: Any
    info: dict | None = None  # None while the actor is unreachable (its process died; Ray may be restarting it)
    actor_pid: int | None = None
    unreachable_since: float | None = None
    restarts_seen: int = 0
    gone: bool = False


class Launcher:
    def __init__(self, cfg: RayLaunchConfig) -> None:
        import ray
        self.ray = ray
        self.cfg = cfg
        self.pg: Any = None
        self.workers: list[Tracked] = []
        self.router: Tracked | None = None
        self.stop = threading.Event()

    # --- start-up -------------------------------------------------------------------------------------------
    def start(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from deploy.ray.actors import ServerActor

        cfg, ray = self.cfg, self.ray
        remote = ray.remote(ServerActor)
        roles = [("prefill", i, cfg.prefill_gpus) for i in range(cfg.prefill)] + \
                [("decode", i, cfg.decode_gpus) for i in range(cfg.decode)]
        for role, i, _ in roles + [("router", 0, 0)]:
            name = self._name(role, i)
            try:
                ray.get_actor(name, namespace=cfg.namespace)
            except ValueError:
                continue
            raise RayLaunchError(f"an actor named {name} already runs in Ray namespace {cfg.namespace!r} (another "
                                 f"launcher?); stop it or pass --namespace")
        bundles = [self._bundle(gpus) for _, _, gpus in roles]
        self.pg = placement_group(bundles, strategy=cfg.placement_strategy, name=f"{cfg.namespace}-workers")
        log(f"waiting for a placement group of {len(bundles)} bundles ({cfg.placement_strategy})")
        if not self.pg.wait(timeout_seconds=int(cfg.startup_timeout)):
            raise RayLaunchError(
                f"Ray could not place {cfg.prefill} prefill and {cfg.decode} decode workers ({bundles}, "
                f"{cfg.placement_strategy}) within {cfg.startup_timeout:g}s; the cluster has "
                f"{ray.cluster_resources()}. Lower --num-cpus-per-worker, --prefill-gpus or --decode-gpus, use "
                f"PACK or SPREAD instead of a STRICT strategy, or add nodes")
        common = split_args(cfg.worker_args)
        # One cluster token for the bootstrap handshakes and one key for the workers' HTTP routes (which only the
        # router presents), made here unless set in the launcher's environment; handed to each actor's process in
        # its environment, and to restarted actors alike (Ray keeps the constructor's arguments).
        token = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        worker_key = os.environ.get(WORKER_API_KEY_ENV) or secrets.token_hex(16)
        worker_secrets = {TOKEN_ENV: token, WORKER_KEY_ENV: worker_key}
        # Decode workers may dial the prefill workers on any node of this Ray cluster (and loopback, private
        # networks); flags given by the user come later and win.
        nodes = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
        allow = ["--prefill-allow", "loopback", "private", *nodes]
        for index, (role, i, gpus) in enumerate(roles):
            extra = common + (allow if role == "decode" else []) + split_args(
                cfg.prefill_args if role == "prefill" else cfg.decode_args)
            handle = remote.options(
                name=self._name(role, i), namespace=cfg.namespace, max_restarts=cfg.max_restarts,
                num_cpus=cfg.num_cpus_per_worker, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
            ).remote(self._name(role, i), role, cfg.model_path, extra, secrets=worker_secrets)
            self.workers.append(Tracked(self._name(role, i), role, handle))
        self._wait_until(lambda: all(t.info and t.info["healthy"] for t in self.workers), "the workers to be healthy")
        endpoints = [self._endpoint(t.info) for t in self.workers if t.info]
        handle = remote.options(
            name=self._name("router", 0), namespace=cfg.namespace, max_restarts=cfg.max_restarts, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(self._name("router", 0), "router", None, split_args(cfg.router_args), cfg.port, cfg.router_host,
                 [e.router_json() for e in endpoints], secrets={WORKER_API_KEY_ENV: worker_key})
        self.router = Tracked(self._name("router", 0), "router", handle)
        self._wait_until(self._router_ready, "the router to see every worker healthy")
        self._wait_until(self._serves, "a first request to go through prefill and decode")

    def _name(self, role: str, i: int) -> str:
        return f"{self.cfg.namespace}-{role}" + ("" if role == "router" else f"-{i}")

    def _bundle(self, gpus: float) -> dict[str, float]:
        bundle = {"CPU": self.cfg.num_cpus_per_worker, "GPU": gpus}
        return {k: v for k, v in bundle.items() if v > 0}

    @staticmethod
    def _endpoint(info: dict) -> Endpoint:
        return Endpoint(info["role"], info["url"], info["bootstrap_port"])

    def _wait_until(self, done: Callable[[], bool], what: str) -> None:
        log(f"waiting for {what}")
        deadline = time.monotonic() + self.cfg.startup_timeout
        while not done():
            if self.stop.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise RayLaunchError(f"gave up waiting for {what} after {self.cfg.startup_timeout:g}s "
                                     f"(--startup-timeout); the actors' output above says why")
            self._poll()
            self.stop.wait(1.0)

    def _router_ready(self) -> bool:
        if not self.router or not self.router.info:
            self._poll()
            return False
        base = self.router.info["url"]
        if probe.status(base + "/readiness") != 200:
            return False
        try:
            workers = probe.router_workers(base)
        except (OSError, ValueError, KeyError):
            return False
        return len(workers) == len(self.workers) and all(w.get("healthy") for w in workers)

    def _serves(self) -> bool:
        assert self.router and self.router.info
        base = self.router.info["url"]
        code, message = probe.first_completion(base, probe.served_model(base) or "")
        if code != 200:
            log(f"first request: status {code}: {message or 'no answer'}; trying again")
        return code == 200

    # --- watching -------------------------------------------------------------------------------------------
    def _poll(self) -> None:
        """Refresh every actor's info; notice restarts (a new actor process) and actors gone for good."""
        tracked = self.workers + ([self.router] if self.router else [])
        refs = {t.name: t.handle.info.remote() for t in tracked if not t.gone}
        for t in tracked:
            if t.gone:
                continue
            try:
                info = self.ray.get(refs[t.name], timeout=5)
            except self.ray.exceptions.GetTimeoutError:
                continue  # restarting or busy: next round
            except self.ray.exceptions.RayActorError as e:
                self._unreachable(t, e)
                continue
            t.unreachable_since = None
            if t.actor_pid is not None and info["actor_pid"] != t.actor_pid:
                t.restarts_seen += 1
                log(f"{t.name} was restarted by Ray (restart {t.restarts_seen}): process {info['pid']} on "
                    f"{info['node_ip']}, now at {info['url']}")
            t.actor_pid = info["actor_pid"]
            t.info = info

    def _unreachable(self, t: Tracked, error: Exception) -> None:
        now = time.monotonic()
        if t.info is not None:  # its process is dead: the router stops using that address at the next reconcile
            log(f"{t.name} died ({type(error).__name__}); its address {t.info['url']} is withdrawn")
            t.info = None
        t.unreachable_since = t.unreachable_since or now
        limit = self.cfg.max_restarts
        out_of_restarts = limit != -1 and t.restarts_seen >= limit
        if out_of_restarts or now - t.unreachable_since > self.cfg.startup_timeout:
            t.gone = True
            log(f"{t.name} is gone for good ({type(error).__name__}: {str(error).splitlines()[0]})")
            if t is self.router:
                raise RayLaunchError("the router actor is gone and Ray will not restart it")
            for role in ("prefill", "decode"):
                if all(w.gone for w in self.workers if w.role == role):
                    raise RayLaunchError(f"no {role} worker actor is left")

    def _reconcile(self) -> None:
        """Make the router's worker list match the workers' current addresses."""
        if not self.router or not self.router.info:
            return
        base = self.router.info["url"]
        try:
            listed = {w["url"] for w in probe.router_workers(base)}
        except (OSError, ValueError, KeyError):
            return  # the router is restarting
        current = {t.info["url"]: t for t in self.workers if t.info and not t.gone}
        for url, t in current.items():
            if url not in listed and t.info and t.info["healthy"]:
                code, body = probe.send_json("POST", base + "/workers", self._endpoint(t.info).router_json())
                log(f"router: added {t.name} at {url}" if code == 200 else f"router refused {url}: {code} {body}")
        for url in listed - set(current):
            code, _ = probe.send_json("DELETE", base + "/workers", {"url": url})
            log(f"router: removed {url}" + ("" if code == 200 else f" (status {code})"))

    def supervise(self) -> None:
        while not self.stop.is_set():
            self._poll()
            self._reconcile()
            self.stop.wait(self.cfg.reconcile_interval)

    def banner(self) -> str:
        assert self.router and self.router.info
        rows = [(t.name, f"{t.info['url']}  node {t.info['node_ip']}  pid {t.info['pid']}")
                for t in self.workers + [self.router] if t.info]
        model = probe.served_model(self.router.info["url"]) or "MODEL"
        footer = (f"Actors are in Ray namespace {self.cfg.namespace!r}; Ray restarts a dead one up to "
                  f"{self.cfg.max_restarts} times.\nCtrl-C stops everything.")
        return ready_banner(self.router.info["url"], model, rows, footer).replace(
            "SplitServe is ready:", "SplitServe is ready on Ray:")

    # --- teardown -------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        ray = self.ray
        tracked = ([self.router] if self.router else []) + self.workers
        stops = [t.handle.stop.remote(self.cfg.shutdown_timeout) for t in tracked if not t.gone]
        if stops:
            log("stopping the processes")
            ray.wait(stops, num_returns=len(stops), timeout=self.cfg.shutdown_timeout + 15)
        for t in tracked:
            try:
                ray.kill(t.handle, no_restart=True)
            except (ValueError, ray.exceptions.RayActorError):
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)
        log("stopped: actors killed, placement group removed")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        cfg.validate()
    except RayLaunchError as e:
        print(f"deploy.ray.launch: {e}", file=sys.stderr)
        return 2
    import ray
    try:
        ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=True)
    except (ConnectionError, RuntimeError) as e:
        print(f"deploy.ray.launch: no Ray cluster at --address {cfg.address} ({e}); start one with "
              f"`ray start --head` or give its HOST:PORT", file=sys.stderr)
        return 2
    launcher = Launcher(cfg)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log(f"{signal.Signals(signum).name}: tearing down")
        launcher.stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        print(launcher.banner(), flush=True)
        launcher.supervise()
        return 0
    except KeyboardInterrupt:  # a signal during start-up
        return 0
    except RayLaunchError as e:
        log(f"{e}; stopping")
        return 1
    finally:
        launcher.teardown()
        for s, handler in previous.items():
            signal.signal(s, handler)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
