"""Settings of the Ray launcher: one frozen dataclass; the command line is built from it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from configflags import add_dataclass_args, dataclass_from_args
from deploy.cluster_config import ClusterConfig

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class RayLaunchError(RuntimeError):
    """The cluster could not be started or cannot serve any more; the message says why and what to change."""


@dataclass(frozen=True)
class RayLaunchConfig(ClusterConfig):
    address: str = field(default="auto", metadata={
        "help": "Ray cluster to join: auto (the one started on this machine with `ray start`) or HOST:PORT"})
    namespace: str = field(default="splitserve", metadata={
        "help": "Ray namespace of the actors (one launcher per namespace)"})
    router_host: str | None = field(default=None, metadata={
        "help": "address the router listens on (default: the node's Ray IP; 0.0.0.0 for all interfaces)"})
    prefill_gpus: float = field(default=0.0, metadata={"help": "GPUs per prefill worker (Ray num_gpus)"})
    decode_gpus: float = field(default=0.0, metadata={"help": "GPUs per decode worker (Ray num_gpus)"})
    num_cpus_per_worker: float = field(default=1.0, metadata={"help": "CPUs reserved per worker (Ray num_cpus)"})
    placement_strategy: str = field(default="PACK", metadata={
        "help": "how the workers' placement group places them: PACK (fill a node first: prefill and decode share "
                "nodes, KV moves over shared memory or NVLink), SPREAD (across nodes), STRICT_PACK, STRICT_SPREAD",
        "choices": STRATEGIES})
    reconcile_interval: float = field(default=1.0, metadata={
        "help": "seconds between checks of the actors (restarts are told to the router then)"})

    error = RayLaunchError

    def validate(self) -> None:
        super().validate()
        if min(self.prefill_gpus, self.decode_gpus, self.num_cpus_per_worker) < 0:
            raise RayLaunchError("--prefill-gpus, --decode-gpus and --num-cpus-per-worker must not be negative")
        if self.num_cpus_per_worker == 0 and 0 in (self.prefill_gpus, self.decode_gpus):
            raise RayLaunchError("a worker must reserve something: give --num-cpus-per-worker or the role's GPUs")
        if self.max_restarts < -1:
            raise RayLaunchError("--max-restarts must be -1 (Ray restarts without limit) or more")


def parse_config(argv: list[str] | None) -> RayLaunchConfig:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.ray.launch",
        description="Run SplitServe on a Ray cluster: the router and the prefill and decode workers as Ray actors "
                    "(restarted by Ray when they die). Ctrl-C or SIGTERM tears everything down.")
    add_dataclass_args(parser, RayLaunchConfig)
    return dataclass_from_args(RayLaunchConfig, parser.parse_args(argv))
