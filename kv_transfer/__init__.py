"""kv_transfer: move KV pages between a prefill and a decode worker (processes or hosts).

It moves pages of a described layout (base addresses + strides) and never imports torch or the
engine. Backends: `mooncake` (Mooncake Transfer Engine; TCP here, RDMA on clusters), `shm` (same
host, the decode pool lives in a SharedSegment), `fake` (in-process, for callers' unit tests);
`auto` = shm when the prefill side can map the decode side's segment, else mooncake.
Full guide: docs/kv_transfer.md.

Public API
----------
Layout
  KVLayout(num_layers, page_size, num_kv_heads, head_dim, dtype, num_pages,
           k_base: tuple[int, ...], v_base: tuple[int, ...], page_stride=0)      frozen
      .page_bytes  .regions()  .check_compatible(remote)  -> LayoutMismatchError(field, local, remote)
      KVLayout.packed(base, *, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype)
      KVLayout.pool_bytes(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype) -> int
  AuxLayout(base, num_slots, record_bytes=32)   .read(slot) -> AuxRecord   .clear(slot)
  AuxRecord(first_token_id, cached_tokens, room)        AuxBuffer(num_slots).layout
  SharedSegment.create(size, name=None) -> .name .size .address .buffer (memoryview) .close()

Config (one frozen dataclass; its fields and defaults are in kv_transfer/config.py; flags --transfer-*)
  TransferConfig(...)     add_transfer_flags(parser)     transfer_config_from_args(namespace) -> TransferConfig

Decode side (receiver)
  DecodeTransferManager(config, layout, aux: AuxLayout, *, worker_id="decode",
                        segments: Sequence[SharedSegment] = (), metrics: TransferMetrics | None = None)
      .create_receiver(room: int, bootstrap_host: str, bootstrap_port: int) -> KVReceiver
      .receiver(room) -> KVReceiver            .connect(host, port, timeout=None) -> str (transport)
      .rooms_by_state() -> dict[RoomState, int] .close()
  KVReceiver
      .init(dst_pages: Sequence[int], aux_slot: int, held_prefix_tokens: int = 0) -> None
      .poll() -> RoomState   .failure -> Failure | None   .failure_reason -> str | None
      .aux_record -> AuxRecord | None (after Success)   .extra_payload -> bytes (after Success)
      .abort(reason)   .release()

Prefill side (sender)
  PrefillTransferManager(config, layout, *, bootstrap_port: int, worker_id="prefill",
                         bootstrap_host="0.0.0.0", metrics=None, server_threads=64)
      .port (bound bootstrap port)   .create_sender(room) -> KVSender   .sender(room) -> KVSender
      .rooms_by_state()   .close()
  KVSender
      .poll() -> RoomState   .dst_pages -> tuple[int, ...] | None   .held_prefix_tokens -> int | None
      .send(src_pages, *, last=False, first_token_id=None, cached_tokens=0, aux_payload=b"",
            extra_payload=b"") -> bool  (non-blocking; extra_payload rides on the Success event)
      .failure  .failure_reason  .abort(reason)  .release()

States and errors
  RoomState: BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS | FAILED
  Failure(kind: FailureKind, message, error)   FailureKind: timeout, peer_dead, peer_unreachable,
      aborted_local, aborted_remote, transfer_io, refused, aux_mismatch, shutdown
  KVTransferError > ConfigError, LayoutMismatchError, DuplicateRoomError, UnknownRoomError,
      UnknownPeerError, PageIndexError, InvalidRoomError, PeerUnreachableError,
      TransportMismatchError, TransferIOError(rc)
Metrics
  TransferMetrics(role, registry=None, prefix="splitserve_")  .snapshot()
"""
from __future__ import annotations

from kv_transfer.wire.aux import AuxBuffer, AuxLayout, AuxRecord
from kv_transfer.config import BACKENDS, TransferConfig, add_transfer_flags, transfer_config_from_args
from kv_transfer.decode.manager import DecodeTransferManager
from kv_transfer.wire.errors import (
    ConfigError, DuplicateRoomError, InvalidRoomError, KVTransferError, LayoutMismatchError, PageIndexError,
    PeerUnreachableError, TransferIOError, TransportMismatchError, UnknownPeerError, UnknownRoomError,
)
from kv_transfer.wire.layout import KVLayout
from kv_transfer.metrics import TransferMetrics
from kv_transfer.prefill.manager import PrefillTransferManager
from kv_transfer.decode.receiver import KVReceiver
from kv_transfer.wire.room_ids import BootstrapFieldError, peer_address, room_id
from kv_transfer.prefill.sender import KVSender
from kv_transfer.shm import SharedSegment
from kv_transfer.state import Failure, FailureKind, RoomState
from kv_transfer.transport.fake import FAULTS as FAKE_FAULTS

__all__ = [
    "AuxBuffer", "AuxLayout", "AuxRecord", "BACKENDS", "BootstrapFieldError", "ConfigError", "DecodeTransferManager",
    "DuplicateRoomError", "FAKE_FAULTS", "Failure", "FailureKind", "InvalidRoomError", "KVLayout",
    "KVReceiver", "KVSender", "KVTransferError", "LayoutMismatchError", "PageIndexError",
    "PeerUnreachableError", "PrefillTransferManager", "RoomState", "SharedSegment", "TransferConfig",
    "TransferIOError", "TransferMetrics", "TransportMismatchError", "UnknownPeerError", "UnknownRoomError",
    "add_transfer_flags", "peer_address", "room_id", "transfer_config_from_args",
]
