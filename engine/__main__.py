"""``python -m engine``: the colocated server (prefill and decode in one process)."""
from __future__ import annotations

import logging

from engine.async_engine import AsyncEngine, build_off_main_thread
from engine.engine_core import EngineCore
from engine.metrics import EngineMetrics
from engine.server.app import build_app
from engine.server.launch import configs_from_args, engine_parser, exit_on_model_error, run, setup_logging
from engine.server.serving import ServingContext

log = logging.getLogger("engine")


def main(argv: list[str] | None = None) -> None:
    args = engine_parser("python -m engine", "SplitServe colocated server", 30000).parse_args(argv)
    server_cfg, engine_cfg = configs_from_args(args)
    setup_logging(server_cfg.log_level)
    with exit_on_model_error("python -m engine"):
        core = build_off_main_thread(lambda: EngineCore(engine_cfg))
    metrics = EngineMetrics(core, role="colocated")
    ctx = ServingContext(AsyncEngine(core, on_outputs=metrics.observe), metrics)
    log.info("serving %s on http://%s:%d", core.served_model_name, server_cfg.host, server_cfg.port)
    run(build_app(ctx, server_cfg), server_cfg, before_grace_ends=ctx.engine.abort_all)


if __name__ == "__main__":
    main()
