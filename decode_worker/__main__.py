"""``python -m decode_worker --model-path DIR --port 30200``"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket

from prometheus_client import CollectorRegistry

from decode_worker.allow import PrefillAllowList
from decode_worker.config import DecodeConfig
from decode_worker.prepare import preparer
from decode_worker.role import DecodeRole
from engine.async_engine import AsyncEngine, build_off_main_thread
from configflags import add_dataclass_args, dataclass_from_args
from engine.engine_core import EngineCore, resolve_device
from engine.metrics import EngineMetrics
from engine.server.app import build_app
from engine.server.launch import configs_from_args, engine_parser, exit_on_model_error, run, setup_logging
from engine.server.serving import ServingContext
from kv_transfer import (AuxBuffer, AuxLayout, DecodeTransferManager, KVLayout, SharedSegment, TransferMetrics,
                         add_transfer_flags, transfer_config_from_args)

log = logging.getLogger("decode_worker")
AUX_RECORD_BYTES = 256  # room for the first token's logprobs (top 20) after the record's header


class PoolMemory:
    """Where the decode worker's KV pool and aux records live: one shared segment when a same-host prefill
    worker may write through shared memory (backend auto or shm, pool in host memory), else private memory."""

    def __init__(self, shared: bool, aux_slots: int) -> None:
        self.shared = shared
        self.aux_slots = aux_slots
        self.segment: SharedSegment | None = None
        self.aux: AuxLayout | None = None
        self._private_aux: AuxBuffer | None = None

    def kv_buffer(self, nbytes: int) -> memoryview:
        aux_bytes = self.aux_slots * AUX_RECORD_BYTES
        self.segment = SharedSegment.create(nbytes + aux_bytes)
        self.aux = AuxLayout(self.segment.address + nbytes, self.aux_slots, AUX_RECORD_BYTES)
        return self.segment.buffer[:nbytes]

    def aux_layout(self) -> AuxLayout:
        if self.aux is None:
            self._private_aux = AuxBuffer(self.aux_slots, AUX_RECORD_BYTES)
            self.aux = self._private_aux.layout
        return self.aux


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> None:
    parser = engine_parser("python -m decode_worker", "SplitServe decode worker", 30200)
    add_dataclass_args(parser, DecodeConfig, "decode")
    add_transfer_flags(parser)
    args = parser.parse_args(argv)
    server_cfg, engine_cfg = configs_from_args(args)
    cfg = dataclass_from_args(DecodeConfig, args)
    transfer_cfg = transfer_config_from_args(args)
    try:
        allow = PrefillAllowList(cfg.prefill_allow)
    except ValueError as e:
        raise SystemExit(f"python -m decode_worker: {e}") from None
    setup_logging(server_cfg.log_level)
    worker = cfg.worker_id or f"decode-{socket.gethostname()}:{server_cfg.port}"
    shared = transfer_cfg.backend in ("auto", "shm") and resolve_device(engine_cfg.model.device).type == "cpu"
    if shared and transfer_cfg.backend == "auto" and is_loopback(server_cfg.host):
        # Reachable on loopback only, so its prefill workers share this host: shared memory serves them, and
        # Mooncake, whose listeners take every interface, is not started (--transfer-backend mooncake forces it).
        transfer_cfg = dataclasses.replace(transfer_cfg, backend="shm")
    memory = PoolMemory(shared, cfg.max_transfer_rooms)
    registry = CollectorRegistry()

    def role(core: EngineCore) -> DecodeRole:  # the transfer manager registers the pool: it comes after it
        manager = DecodeTransferManager(
            transfer_cfg, KVLayout.packed(**core.pool.describe()), memory.aux_layout(), worker_id=worker,
            segments=[memory.segment] if memory.segment else [], metrics=TransferMetrics("decode", registry=registry))
        return DecodeRole(manager, cfg, worker)
    with exit_on_model_error("python -m decode_worker"):
        core = build_off_main_thread(
            lambda: EngineCore(engine_cfg, kv_buffer=memory.kv_buffer if shared else None, role=role))
    metrics = EngineMetrics(core, role="decode", registry=registry)
    ctx = ServingContext(AsyncEngine(core, on_outputs=metrics.observe), metrics, role="decode",
                         prepare=preparer(allow))
    log.info("decode worker %s: http://%s:%d, transfer backend %s%s", worker, server_cfg.host, server_cfg.port,
             transfer_cfg.backend, " (pool in shared memory)" if shared else "")

    async def close_segment() -> None:
        if memory.segment is not None:
            memory.segment.close()
    run(build_app(ctx, server_cfg, on_stop=close_segment), server_cfg, before_grace_ends=ctx.engine.abort_all)


if __name__ == "__main__":
    main()
