"""Command-line plumbing shared by the colocated server and the worker roles: flags derived from the config
dataclasses, logging set-up, and running uvicorn with graceful shutdown."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from configflags import add_dataclass_args, dataclass_from_args
from engine.config import (
    API_KEY_ENV,
    CacheConfig,
    EngineConfig,
    EngineConfigError,
    GrammarConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from engine.models.config import ModelLoadError
from engine.server.http1 import JsonErrorsH11Protocol

log = logging.getLogger(__name__)


def engine_parser(prog: str, description: str, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(parser, ServerConfig, "server")
    parser.set_defaults(port=default_port)
    add_dataclass_args(parser, ModelConfig, "model")
    add_dataclass_args(parser, CacheConfig, "KV cache")
    add_dataclass_args(parser, SchedulerConfig, "scheduler")
    add_dataclass_args(parser, GrammarConfig, "structured output")
    add_dataclass_args(parser, SpeculativeConfig, "speculative decoding")
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    server = dataclass_from_args(ServerConfig, args)
    key = server.api_key or os.environ.get(API_KEY_ENV) or None
    if key is None and server.api_key_file:
        try:
            key = Path(server.api_key_file).read_text().strip()
        except OSError as e:
            raise SystemExit(f"--api-key-file {server.api_key_file}: {e.strerror}") from None
        if not key:
            raise SystemExit(f"--api-key-file {server.api_key_file} is empty")
    server = dataclasses.replace(server, api_key=key, api_key_file=None)
    return server, EngineConfig(
        model=dataclass_from_args(ModelConfig, args), cache=dataclass_from_args(CacheConfig, args),
        scheduler=dataclass_from_args(SchedulerConfig, args), grammar=dataclass_from_args(GrammarConfig, args),
        speculative=dataclass_from_args(SpeculativeConfig, args))


@contextlib.contextmanager
def exit_on_model_error(prog: str) -> Iterator[None]:
    """A model we cannot serve, or a setting the engine cannot run with, ends the process at start with status 2
    and one line naming what is wrong (and what is supported), not a traceback."""
    try:
        yield
    except (ModelLoadError, EngineConfigError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _Server(uvicorn.Server):
    before_grace_ends: Callable[[], None] | None = None

    async def shutdown(self, sockets: list | None = None) -> None:
        """Just before the grace period ends, ``before_grace_ends`` aborts what is still running, so those
        clients get a JSON 503 instead of a cut connection."""
        grace = self.config.timeout_graceful_shutdown or 0
        timer = None
        if self.before_grace_ends is not None and grace:
            timer = asyncio.get_running_loop().call_later(max(0.0, grace - 0.5), self.before_grace_ends)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start a graceful shutdown (a second one forces it); afterwards the process exits
        normally with status 0 (uvicorn would re-raise the signal)."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def freeze_start_up_objects() -> int:
    """Collects once, then moves every object still alive (the model's modules and tensors, the tokenizer, the
    imported modules: ~260,000 objects for SmolLM2) into the collector's permanent generation, where its full
    collections no longer walk them; returns how many were frozen. Why: a full collection walked them all, 112-117
    ms in process on a Zen 4 host (2 cores), and one came in a served batch-64 decode step (148 ms on the engine
    thread, inside a 261 ms step where its neighbours took 128-146: every stream's next token 148 ms late). Objects
    made later are collected as before; start-up objects that become cyclic garbage later are not (as with
    vLLM's and SGLang's freezing)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run(app: FastAPI, cfg: ServerConfig, before_grace_ends: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` seconds to finish. What start-up
    left alive is frozen first (``freeze_start_up_objects``)."""
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            http=JsonErrorsH11Protocol, h11_max_incomplete_event_size=cfg.max_header_size,
                            timeout_graceful_shutdown=max(1, int(cfg.shutdown_timeout)),
                            access_log=cfg.log_level == "debug")
    server = _Server(config)
    server.before_grace_ends = before_grace_ends
    log.info("froze %d start-up objects out of the garbage collector's full collections", freeze_start_up_objects())
    server.run()
