"""The gRPC bootstrap server (prefill side): translates the handshake into manager calls.

Typed errors travel in-band in each reply's `error` field; Subscribe streams a peer's room events
plus a heartbeat every heartbeat interval, and ends when the peer is dropped. A stream the decode
side closes (process gone) drops the peer at once, failing its rooms.
"""
from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc

from kv_transfer.auth import TokenCheck
from kv_transfer.wire.errors import ConfigError, KVTransferError, UnknownPeerError
from kv_transfer.wire.protogen import stubs
from kv_transfer.wire.messages import error_to_msg

if TYPE_CHECKING:
    from kv_transfer.prefill.manager import PrefillTransferManager

log = logging.getLogger("kv_transfer")


def _guard(reply_cls: Any, fn: Callable[[], dict[str, Any] | None]) -> Any:
    try:
        return reply_cls(**(fn() or {}))
    except KVTransferError as exc:
        return reply_cls(error=error_to_msg(exc))


def _make_servicer(manager: "PrefillTransferManager") -> Any:
    pb2, pb2_grpc = stubs()
    interval = manager.config.heartbeat_interval

    class Servicer(pb2_grpc.KVBootstrapServicer):  # type: ignore[misc, name-defined]
        def RegisterPeer(self, request: Any, context: grpc.ServicerContext) -> Any:
            return _guard(pb2.RegisterPeerReply,
                          lambda: {"worker": manager.worker_id, "transport": manager.register_peer(request)})

        def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
            return _guard(pb2.HeartbeatReply, lambda: manager.peer(request.peer_id).touch())

        def OpenRoom(self, request: Any, context: grpc.ServicerContext) -> Any:
            return _guard(pb2.OpenRoomReply, lambda: manager.open_room(request))

        def AbortRoom(self, request: Any, context: grpc.ServicerContext) -> Any:
            return _guard(pb2.AbortRoomReply,
                          lambda: manager.abort_room(request.peer_id, request.room, request.reason))

        def StagingDone(self, request: Any, context: grpc.ServicerContext) -> Any:
            return _guard(pb2.StagingDoneReply, lambda: manager.staging_done(request.peer_id, request.slot))

        def Subscribe(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                peer = manager.peer(request.peer_id)
            except UnknownPeerError as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, exc.message)
                return
            context.add_callback(lambda: manager.peer_disconnected(peer, "closed its event stream"))
            heartbeat = pb2.RoomEvent(heartbeat=True)
            while peer.alive and context.is_active():
                try:
                    event = peer.events.get(timeout=interval)
                except queue.Empty:
                    event = heartbeat
                if event is None:
                    return
                yield event

    return Servicer()


def start_bootstrap_server(manager: "PrefillTransferManager", host: str, port: int,
                           threads: int) -> tuple[grpc.Server, int]:
    """Start serving; returns (server, bound port). Port 0 picks a free port."""
    _, pb2_grpc = stubs()
    token = manager.config.cluster_token
    server = grpc.server(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-bootstrap"),
                         interceptors=[TokenCheck(token)] if token else None, options=[("grpc.so_reuseport", 0)])
    pb2_grpc.add_KVBootstrapServicer_to_server(_make_servicer(manager), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} for the bootstrap server ({exc}); "
                          "pick another --bootstrap-port") from exc
    if bound == 0:
        raise ConfigError(f"cannot listen on {host}:{port} for the bootstrap server; pick another --bootstrap-port")
    server.start()
    return server, bound
