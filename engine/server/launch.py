"""Command-line plumbing shared by the colocated server and the worker roles: flags derived from the config
dataclasses, logging set-up, and running uvicorn with graceful shutdown."""
from __future__ import annotations

import argparse
import logging

import uvicorn
from fastapi import FastAPI

from engine.cli_args import add_dataclass_args, dataclass_from_args
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig


def engine_parser(prog: str, description: str, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(parser, ServerConfig, "server")
    parser.set_defaults(port=default_port)
    add_dataclass_args(parser, ModelConfig, "model")
    add_dataclass_args(parser, CacheConfig, "KV cache")
    add_dataclass_args(parser, SchedulerConfig, "scheduler")
    return parser


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    return dataclass_from_args(ServerConfig, args), EngineConfig(
        model=dataclass_from_args(ModelConfig, args), cache=dataclass_from_args(CacheConfig, args),
        scheduler=dataclass_from_args(SchedulerConfig, args))


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(app: FastAPI, cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout`` seconds to finish."""
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level if cfg.log_level != "debug" else "info",
                timeout_graceful_shutdown=int(cfg.shutdown_timeout), access_log=cfg.log_level == "debug")
