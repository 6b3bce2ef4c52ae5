"""``python -m prefill_worker --model-path DIR --port 30100 --bootstrap-port 8998``"""
from __future__ import annotations

import logging
import socket

from prometheus_client import CollectorRegistry

from engine.async_engine import AsyncEngine, build_off_main_thread
from configflags import add_dataclass_args, dataclass_from_args
from engine.engine_core import EngineCore
from engine.metrics import EngineMetrics
from engine.server.app import build_app
from engine.server.launch import configs_from_args, engine_parser, exit_on_model_error, run, setup_logging
from engine.server.serving import ServingContext
from kv_transfer import KVLayout, PrefillTransferManager, TransferMetrics, add_transfer_flags, transfer_config_from_args
from prefill_worker.config import PrefillConfig
from prefill_worker.prepare import prepare
from prefill_worker.role import PrefillRole

log = logging.getLogger("prefill_worker")


def main(argv: list[str] | None = None) -> None:
    parser = engine_parser("python -m prefill_worker", "SplitServe prefill worker", 30100)
    add_dataclass_args(parser, PrefillConfig, "prefill")
    add_transfer_flags(parser)
    args = parser.parse_args(argv)
    server_cfg, engine_cfg = configs_from_args(args)
    if engine_cfg.speculative.enabled:
        parser.error("--speculative-algorithm is for decode workers (and the colocated server): a prefill worker "
                     "computes a prompt and its first token only, with nothing to speculate on")
    cfg = dataclass_from_args(PrefillConfig, args)
    transfer_cfg = transfer_config_from_args(args)
    setup_logging(server_cfg.log_level)
    worker = cfg.worker_id or f"prefill-{socket.gethostname()}:{server_cfg.port}"
    registry = CollectorRegistry()

    def role(core: EngineCore) -> PrefillRole:  # the transfer manager registers the pool: it comes after it
        manager = PrefillTransferManager(
            transfer_cfg, KVLayout.packed(**core.pool.describe()), bootstrap_port=cfg.bootstrap_port,
            bootstrap_host=cfg.bootstrap_host or server_cfg.host, worker_id=worker,
            metrics=TransferMetrics("prefill", registry=registry))
        return PrefillRole(manager, worker)
    with exit_on_model_error("python -m prefill_worker"):
        core = build_off_main_thread(lambda: EngineCore(engine_cfg, role=role))
    metrics = EngineMetrics(core, role="prefill", registry=registry)
    ctx = ServingContext(AsyncEngine(core, on_outputs=metrics.observe), metrics, role="prefill", prepare=prepare)
    log.info("prefill worker %s: http://%s:%d, bootstrap port %d, transfer backend %s", worker, server_cfg.host,
             server_cfg.port, core.role.manager.port, transfer_cfg.backend)
    run(build_app(ctx, server_cfg), server_cfg, before_grace_ends=ctx.engine.abort_all)


if __name__ == "__main__":
    main()
