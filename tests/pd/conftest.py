"""A real disaggregated cluster on loopback for the PD tests: prefill and decode worker processes, the Rust
router in PD mode in front of them, and a colocated server with the same settings as the reference."""
from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, free_port

# Same page size and chunking everywhere, so the colocated reference runs the same arithmetic.
ENGINE = ["--page-size", "4", "--chunked-prefill-size", "32"]
# Short deadlines so failure tests finish quickly; the flags are the workers' real ones.
TRANSFER = ["--transfer-heartbeat-interval", "0.2", "--transfer-heartbeat-timeout", "2",
            "--transfer-bootstrap-timeout", "5", "--transfer-waiting-timeout", "10",
            "--transfer-transfer-timeout", "5", "--transfer-rpc-timeout", "2"]


def start_prefill(model: Path, *extra: str, tokens: int = 16384) -> tuple[ServerProcess, int]:
    bport = free_port()
    srv = ServerProcess("prefill_worker", ["--model-path", str(model), "--bootstrap-port", str(bport),
                                           "--max-total-tokens", str(tokens), *ENGINE, *TRANSFER, *extra])
    return srv, bport


def start_decode(model: Path, *extra: str, tokens: int = 16384) -> ServerProcess:
    return ServerProcess("decode_worker", ["--model-path", str(model), "--max-total-tokens", str(tokens),
                                           "--kv-quarantine", "0.5", *ENGINE, *TRANSFER, *extra])


def start_colocated(model: Path, *extra: str, tokens: int = 16384) -> ServerProcess:
    return ServerProcess("engine", ["--model-path", str(model), "--max-total-tokens", str(tokens), *ENGINE, *extra])


def start_router(prefill: ServerProcess, bport: int, decode: ServerProcess, *extra: str) -> ServerProcess:
    return ServerProcess("router.launch_router", [
        "--pd-disaggregation", "--prefill", prefill.url, str(bport), "--decode", decode.url,
        "--health-check-interval", "1", *extra])


def metric_sum(url: str, name: str) -> float:
    """The sum of a Prometheus counter's samples over all its labels, from ``url``'s /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def bootstrap(bport: int, room: int) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room}


def pool_used_after_flush(server: ServerProcess) -> int:
    httpx.post(server.url + "/flush_cache", timeout=30)
    return httpx.get(server.url + "/get_load", timeout=10).json()["kv_pages_used"]


def wait_pool_idle(server: ServerProcess, timeout: float = 20.0) -> None:
    """Both idle queues and, after a cache flush, no page in use (quarantines included)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(server.url + "/get_load", timeout=10).json()
        if load["running"] == 0 and load["queued"] == 0 and pool_used_after_flush(server) == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.url} pool not idle after {timeout}s: {load}")
        time.sleep(0.2)


@dataclass
class Cluster:
    prefill: ServerProcess
    bport: int
    decode: ServerProcess
    colocated: ServerProcess
    router: ServerProcess


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from engine.tiny_model import ensure_tiny_model
    return ensure_tiny_model()


def run_cluster(model: Path, *decode_args: str, decode_tokens: int = 16384, flags: tuple[str, ...] = (),
                worker_flags: tuple[str, ...] = (), router_flags: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """Start a cluster, yield it, stop it (the body of the cluster fixtures). ``flags`` go to all three servers
    (prefill, decode and the colocated reference), ``worker_flags`` to both workers, ``decode_args`` to the
    decode worker only."""
    prefill, bport = start_prefill(model, *flags, *worker_flags)
    decode = start_decode(model, *flags, *worker_flags, *decode_args, tokens=decode_tokens)
    colocated = start_colocated(model, *flags)
    router = None
    try:
        for srv in (prefill, decode, colocated):
            srv.wait_ready()
        router = start_router(prefill, bport, decode, *router_flags).wait_ready(path="/readiness")
        yield Cluster(prefill, bport, decode, colocated, router)
    finally:
        if router is not None:
            router.stop()
        for srv in (prefill, decode, colocated):
            srv.stop()


pd_cluster = contextmanager(run_cluster)  # the same cluster for a single test: ``with pd_cluster(...) as c:``


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    yield from run_cluster(tiny_model_dir)
