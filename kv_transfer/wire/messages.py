"""Conversions between kv_transfer's types and the bootstrap handshake's protobuf messages."""
from __future__ import annotations

from typing import Any

from kv_transfer.wire.aux import AuxLayout
from kv_transfer.wire.errors import InvalidRoomError, KVTransferError, LayoutMismatchError, error_from_wire
from kv_transfer.wire.layout import KVLayout
from kv_transfer.wire.protogen import stubs
from kv_transfer.state import RoomState
from kv_transfer.transport.select import Offer

MAX_ROOM = 2**63


def check_room_id(room: int) -> int:
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise InvalidRoomError(f"room id {room!r} is not an integer in [0, 2**63)")
    return room


def pb() -> Any:
    return stubs()[0]


def layout_to_msg(layout: KVLayout) -> Any:
    return pb().KVLayoutMsg(
        num_layers=layout.num_layers, page_size=layout.page_size, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, dtype=layout.dtype, num_pages=layout.num_pages,
        k_base=list(layout.k_base), v_base=list(layout.v_base), page_stride=layout.stride,
    )


def layout_from_msg(msg: Any) -> KVLayout:
    return KVLayout(
        num_layers=msg.num_layers, page_size=msg.page_size, num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim, dtype=msg.dtype, num_pages=msg.num_pages,
        k_base=tuple(msg.k_base), v_base=tuple(msg.v_base), page_stride=msg.page_stride,
    )


def aux_to_msg(aux: AuxLayout) -> Any:
    return pb().AuxLayoutMsg(base=aux.base, num_slots=aux.num_slots, record_bytes=aux.record_bytes)


def aux_from_msg(msg: Any) -> AuxLayout:
    return AuxLayout(base=msg.base, num_slots=msg.num_slots, record_bytes=msg.record_bytes)


def offer_to_msg(offer: Offer) -> Any:
    m = pb()
    return m.TransportOffer(
        mooncake_session=offer.mooncake_session,
        shm_regions=[m.ShmRegion(name=n, nonce=nonce, base=b, size=s) for n, nonce, b, s in offer.shm_regions],
        fake_session=offer.fake_session,
    )


def offer_from_msg(msg: Any) -> Offer:
    return Offer(
        mooncake_session=msg.mooncake_session,
        shm_regions=tuple((r.name, bytes(r.nonce), r.base, r.size) for r in msg.shm_regions),
        fake_session=msg.fake_session,
    )


def error_to_msg(exc: KVTransferError) -> Any:
    if isinstance(exc, LayoutMismatchError):
        return pb().ErrorInfo(code=exc.code, message=exc.message, field=exc.field,
                              local_value=str(exc.local), remote_value=str(exc.remote))
    return pb().ErrorInfo(code=exc.code, message=exc.message)


def raise_if_error(msg: Any, peer: str) -> None:
    """Raise the typed error carried in a reply's `error` field, if any."""
    if msg.HasField("error") and msg.error.code:
        e = msg.error
        raise error_from_wire(e.code, e.message, e.field, e.local_value, e.remote_value, peer=peer)


def state_to_msg(state: RoomState) -> int:
    return int(state)  # RoomStateMsg values mirror RoomState


def state_from_msg(value: int) -> RoomState:
    return RoomState(value)
