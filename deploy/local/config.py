"""``splitserve up`` settings: one frozen dataclass; the command line is built from it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from configflags import add_dataclass_args, dataclass_from_args
from deploy.cluster_config import ClusterConfig


class UpConfigError(ValueError):
    """A setting ``splitserve up`` cannot run with; the message names the flag to change."""


@dataclass(frozen=True)
class UpConfig(ClusterConfig):
    host: str = field(default="127.0.0.1", metadata={
        "help": "address the router and the workers listen on"})
    run_dir: str | None = field(default=None, metadata={
        "help": "folder for the processes' log files (default: runs/up-<date>-<time> under the current folder)"})
    restart: bool = field(default=False, metadata={
        "help": "restart a process that dies (at most --max-restarts times each, with growing pauses)"})
    log_tail: int = field(default=30, metadata={"help": "log lines shown when a process dies"})

    error = UpConfigError

    def validate(self) -> None:
        super().validate()
        if self.max_restarts < 0 or self.log_tail < 0:
            raise UpConfigError("--max-restarts and --log-tail must not be negative")


def build_parser(prog: str = "splitserve up") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the whole SplitServe cluster on this machine: the router and N prefill and M decode "
                    "worker processes. Ctrl-C (or SIGTERM) stops all of it.")
    add_dataclass_args(parser, UpConfig)
    return parser


def parse_config(argv: list[str] | None, prog: str = "splitserve up") -> UpConfig:
    return dataclass_from_args(UpConfig, build_parser(prog).parse_args(argv))
