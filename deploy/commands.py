"""The command lines of SplitServe's three processes, built in one place for ``splitserve up`` and the Ray
launcher (the Helm chart's templates write the same flags; tests/deploy checks them against the real parsers)."""
from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """A worker as the router knows it."""
    role: str  # "prefill" | "decode"
    url: str
    bootstrap_port: int | None = None

    def router_flags(self) -> list[str]:
        if self.role == "prefill":
            return ["--prefill", self.url] + ([str(self.bootstrap_port)] if self.bootstrap_port is not None else [])
        return ["--decode", self.url]

    def router_json(self) -> dict:
        return {"url": self.url, "role": self.role, "bootstrap_port": self.bootstrap_port}


# Launchers start the router with quicker health checks than its default, so a restarted worker is back in seconds.
ROUTER_DEFAULTS = ("--health-check-interval-secs", "1")


def split_args(text: str) -> list[str]:
    """Extra flags given as one shell-quoted string (``--worker-args "--page-size 4"``)."""
    return shlex.split(text) if text else []


def _model_flags(model_path: str | None) -> list[str]:
    return ["--model-path", model_path] if model_path else []


def prefill_argv(*, host: str, port: int, bootstrap_port: int, model_path: str | None,
                 extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "prefill_worker", "--host", host, "--port", str(port),
            "--bootstrap-port", str(bootstrap_port), *_model_flags(model_path), *extra]


def decode_argv(*, host: str, port: int, model_path: str | None, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "decode_worker", "--host", host, "--port", str(port),
            *_model_flags(model_path), *extra]


def router_argv(*, host: str, port: int, workers: Sequence[Endpoint], extra: Sequence[str] = ()) -> list[str]:
    flags = [f for w in workers for f in w.router_flags()]
    return [sys.executable, "-m", "router.launch_router", "--pd-disaggregation", *flags,
            "--host", host, "--port", str(port), *ROUTER_DEFAULTS, *extra]


def url(host: str, port: int) -> str:
    return f"http://{host}:{port}"
