"""PeerLink: the decode side's connection to one prefill worker's bootstrap server.

One op thread registers this manager (layout, aux, transport offer), then sends OpenRoom/AbortRoom
and a heartbeat every heartbeat interval, each gRPC call with its own deadline; a stream thread
reads room events. The link dies on any transport failure, an unknown-peer answer, or (checked by
the manager's monitor) prefill silence longer than the heartbeat timeout; dying fails its rooms.
A dead link is never reused: the next room to that address opens a new one.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

import grpc

from kv_transfer.auth import TokenSender
from kv_transfer.wire.aux import MAX_EXTRA_PAYLOAD
from kv_transfer.config import TransferConfig
from kv_transfer.wire.errors import KVTransferError, PeerUnreachableError, UnknownPeerError, UnknownRoomError
from kv_transfer.wire.protogen import stubs
from kv_transfer.state import FailureKind
from kv_transfer.decode.receiver import Opened, PeerFailed, Remote, Staged
from kv_transfer.wire.messages import raise_if_error, state_from_msg

if TYPE_CHECKING:
    from kv_transfer.decode.receiver import KVReceiver
    from kv_transfer.staging import StagingArea

log = logging.getLogger("kv_transfer")


class PeerLink:
    def __init__(self, host: str, port: int, config: TransferConfig, worker: str,
                 register_request: Callable[[str, "StagingArea | None"], Any],
                 staging: "StagingArea | None" = None) -> None:
        self.address = f"{host}:{port}"
        self.staging = staging  # slots this prefill peer may stage scattered pages through
        self.peer_id = f"{worker}-{uuid.uuid4().hex[:12]}"
        self._config = config
        self._worker = worker
        self._register_request = register_request
        self._rooms: dict[int, "KVReceiver"] = {}
        self._lock = threading.Lock()
        self._ops: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self.alive = True
        self.registered = threading.Event()
        self.error: KVTransferError | None = None
        self.last_heard = time.monotonic()
        self.transport = ""
        self._kind, self._message = FailureKind.PEER_DEAD, ""  # why the link died
        self._stream: Any = None
        pb2, pb2_grpc = stubs()
        self._pb = pb2
        channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", MAX_EXTRA_PAYLOAD + (1 << 20))])  # a Success event's extra payload
        self._channel = channel
        if config.cluster_token:
            channel = grpc.intercept_channel(channel, TokenSender(config.cluster_token))
        self._stub = pb2_grpc.KVBootstrapStub(channel)
        threading.Thread(target=self._run_ops, name=f"kv-link-{self.address}", daemon=True).start()

    # --- used by the manager and receivers ----------------------------------------------------
    def attach(self, receiver: "KVReceiver") -> None:
        with self._lock:
            self._rooms[receiver.room] = receiver
        if not self.alive:  # raced with death: fail it like the others
            self._fail_rooms([receiver])

    def detach(self, receiver: "KVReceiver") -> None:
        """Stop routing events to `receiver` (a newer room of the same id keeps its own)."""
        with self._lock:
            if self._rooms.get(receiver.room) is receiver:
                del self._rooms[receiver.room]

    def open_room(self, receiver: "KVReceiver") -> None:
        self._ops.put(lambda: self._open_room(receiver))

    def abort_room(self, room: int, reason: str) -> None:
        self._ops.put(lambda: self._abort_room(room, reason))

    def check_silence(self, now: float) -> None:
        if self.alive and self.registered.is_set() and now - self.last_heard > self._config.heartbeat_timeout:
            self.die(FailureKind.PEER_DEAD, f"prefill {self.address} silent for more than "
                                            f"{self._config.heartbeat_timeout:g}s (dead or frozen)")

    def die(self, kind: FailureKind, message: str, error: KVTransferError | None = None) -> None:
        with self._lock:
            if not self.alive:
                return
            self._kind, self._message = kind, message
            self.error = error or PeerUnreachableError(message, peer=self.address)
            self.alive = False
            rooms = [r for r in self._rooms.values() if not r.state.terminal]
        log.log(logging.WARNING if rooms else logging.INFO, "prefill link down peer=%s why=%s rooms_in_flight=%d",
                self.address, message, len(rooms), extra={"peer": self.address, "worker": self._worker})
        self.registered.set()  # wake anyone waiting in connect()
        self._ops.put(None)
        if self._stream is not None:
            self._stream.cancel()
        self._fail_rooms(rooms)
        self._channel.close()

    # --- internals ------------------------------------------------------------------------------
    def _fail_rooms(self, rooms: list["KVReceiver"]) -> None:
        for r in rooms:
            r.feed(PeerFailed(self._kind, self._message, self.error))

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """A unary call with our deadline; transport errors kill the link and return None."""
        if not self.alive:
            return None
        try:
            reply = getattr(self._stub, method)(request, timeout=timeout or self._config.rpc_timeout)
        except ValueError:  # the channel was closed by die() meanwhile
            return None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                self.die(FailureKind.REFUSED, f"prefill bootstrap server {self.address} refused our cluster token "
                                              f"({method}): give both workers the same --cluster-token")
                return None
            what = "did not answer in time" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "is unreachable"
            kind = FailureKind.PEER_UNREACHABLE if not self.registered.is_set() else FailureKind.PEER_DEAD
            self.die(kind, f"prefill bootstrap server {self.address} {what} ({method}: {code})")
            return None
        self.last_heard = time.monotonic()
        return reply

    def _run_ops(self) -> None:
        if not self._register():
            return
        interval = self._config.heartbeat_interval
        next_beat = time.monotonic() + interval
        while self.alive:
            try:
                op = self._ops.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                op = self._heartbeat
            if op is None:
                return
            op()
            if op == self._heartbeat:
                next_beat = time.monotonic() + interval

    def _register(self) -> bool:
        reply = self._register_call()
        if reply is None:
            return False
        try:
            raise_if_error(reply, self.address)
        except KVTransferError as exc:
            self.die(FailureKind.REFUSED, f"prefill {self.address} refused registration: {exc.message}", exc)
            return False
        self.transport = reply.transport
        self._stream = self._stub.Subscribe(self._pb.SubscribeRequest(peer_id=self.peer_id))
        threading.Thread(target=self._read_events, name=f"kv-events-{self.address}", daemon=True).start()
        self.last_heard = time.monotonic()
        self.registered.set()
        log.info("registered with prefill peer=%s transport=%s", self.address, self.transport,
                 extra={"peer": self.address, "worker": self._worker})
        return True

    def _register_call(self) -> Any:
        """RegisterPeer; a server that is slow to answer (a prefill worker still starting, a loaded machine) is
        asked again with backoff until the bootstrap deadline, a refused connection fails at once."""
        # finish before the rooms' own Bootstrapping deadline, so they fail as peer_unreachable, not timeout
        deadline = time.monotonic() + self._config.bootstrap_timeout * 0.9
        delay = 0.1
        request = self._register_request(self.peer_id, self.staging)
        while True:
            remaining = deadline - time.monotonic()
            timeout = max(0.1, min(self._config.rpc_timeout, remaining))
            if remaining - timeout < delay or not self.alive:  # the last try gets the normal treatment
                return self._call("RegisterPeer", request, timeout)
            try:
                reply = self._stub.RegisterPeer(request, timeout=timeout)
            except ValueError:  # the channel was closed by die() meanwhile
                return None
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    return self._call("RegisterPeer", request, timeout)  # fails the link the usual way
                log.warning("prefill %s slow to answer RegisterPeer; asking again", self.address,
                            extra={"peer": self.address, "worker": self._worker})
                time.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            self.last_heard = time.monotonic()
            return reply

    def _read_events(self) -> None:
        why = "event stream ended"
        try:
            for event in self._stream:
                self.last_heard = time.monotonic()
                if event.heartbeat:
                    continue
                with self._lock:
                    receiver = self._rooms.get(event.room)
                if event.HasField("staged"):
                    self._unstage(receiver, event.staged)
                if receiver is not None:
                    receiver.feed(Remote(state_from_msg(event.state), event.pages_done, event.failure_kind,
                                         event.reason, bytes(event.extra_payload)))
        except grpc.RpcError as exc:
            why = f"event stream broke ({exc.code() if hasattr(exc, 'code') else exc})"
        except ValueError:  # the channel was closed by die() meanwhile
            why = "link closed"
        self.die(FailureKind.PEER_DEAD, f"prefill {self.address}: {why}")

    def _unstage(self, receiver: "KVReceiver | None", staged: Any) -> None:
        """Copy a staged slot into its room's pages (in stream order: before that room's Success), then free
        the slot on the prefill side, also when the room is gone or the copy was refused."""
        slot = staged.slot
        try:
            if receiver is not None:
                receiver.feed(Staged(self.staging, staged.slot, staged.first, staged.count))
        finally:
            self._ops.put(lambda: self._staging_done(slot))

    def _staging_done(self, slot: int) -> None:
        reply = self._call("StagingDone", self._pb.StagingDoneRequest(peer_id=self.peer_id, slot=slot))
        if reply is None:
            return
        try:
            raise_if_error(reply, self.address)
        except KVTransferError as exc:  # the prefill side lost track of its slots: nothing staged can be trusted
            self.die(FailureKind.TRANSFER_IO, f"prefill {self.address} refused StagingDone: {exc.message}", exc)

    def _heartbeat(self) -> None:
        reply = self._call("Heartbeat", self._pb.HeartbeatRequest(peer_id=self.peer_id))
        if reply is None:
            return
        try:
            raise_if_error(reply, self.address)
        except UnknownPeerError as exc:
            self.die(FailureKind.PEER_DEAD, f"prefill {self.address} no longer knows this decode worker", exc)

    def _open_room(self, receiver: "KVReceiver") -> None:
        req = receiver.open_request()
        if req is None:
            return
        reply = self._call("OpenRoom", self._pb.OpenRoomRequest(
            peer_id=self.peer_id, room=req.room, dst_pages=list(req.dst_pages), aux_slot=req.aux_slot,
            held_prefix_tokens=req.held_prefix_tokens))
        if reply is None:
            return
        try:
            raise_if_error(reply, self.address)
        except KVTransferError as exc:
            exc.room = req.room
            receiver.feed(PeerFailed(FailureKind.REFUSED, f"prefill refused the room: {exc.message}", exc))
            return
        receiver.feed(Opened())

    def _abort_room(self, room: int, reason: str) -> None:
        reply = self._call("AbortRoom", self._pb.AbortRoomRequest(peer_id=self.peer_id, room=room, reason=reason))
        if reply is None:
            return
        try:
            raise_if_error(reply, self.address)
        except UnknownRoomError:
            pass  # the prefill side already forgot it
        except KVTransferError as exc:
            log.info("abort not applied room=%d peer=%s why=%s", room, self.address, exc.message,
                     extra={"room": room, "peer": self.address})
