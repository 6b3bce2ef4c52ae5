"""Fixtures for the load tool's tests: a real colocated server on the tiny model, the fault-injecting server
(a real process on 127.0.0.1), and a helper that runs the tool in-process and loads its JSON."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_serving import main as bench_main
from engine.tiny_model import ensure_tiny_model
from tests.helpers import ServerProcess

BenchRunner = Callable[..., dict[str, Any]]
FaultFactory = Callable[..., ServerProcess]


@pytest.fixture(scope="session")
def colocated() -> Iterator[ServerProcess]:
    srv = ServerProcess("engine", ["--model-path", str(ensure_tiny_model()), "--max-total-tokens", "16384",
                                   "--page-size", "4", "--chunked-prefill-size", "64"]).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture
def fault_server() -> Iterator[FaultFactory]:
    started: list[ServerProcess] = []

    def start(**opts: Any) -> ServerProcess:
        args = [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
        srv = ServerProcess("tests.bench_serving.fault_server", args).wait_ready(timeout=30)
        started.append(srv)
        return srv
    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def run_bench(tmp_path: Path) -> BenchRunner:
    """Run the tool with ``args`` (plus quiet, bounded defaults; plots only when asked, they take seconds) and
    return its result JSON; ``run_bench.paths`` lists the JSON files written."""

    def run(base_url: str, *args: str, plots: bool = False) -> dict[str, Any]:
        out = tmp_path / f"run{len(run.paths) + 1}.json"  # type: ignore[attr-defined]
        argv = ["--base-url", base_url, "--output", str(out), "--no-progress", "--max-duration", "60",
                "--request-timeout", "60", *([] if plots else ["--no-plots"]), *args]
        assert bench_main(argv) == 0
        run.paths.append(out)  # type: ignore[attr-defined]
        return json.loads(out.read_text())
    run.paths = []  # type: ignore[attr-defined]
    return run
