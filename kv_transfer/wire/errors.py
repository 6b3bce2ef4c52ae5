"""Typed errors of kv_transfer. Every message names what went wrong and, where there is one, the fix.

Errors that cross the bootstrap handshake travel as (code, message, field, local, remote) and are
rebuilt on the other side by `error_from_wire`, so both sides raise the same type.
"""
from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error raised by kv_transfer."""

    code = "internal"

    def __init__(self, message: str, *, room: int | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.room = room
        self.peer = peer


class ConfigError(KVTransferError):
    """Bad configuration or an unusable environment (missing package, unreachable segment)."""

    code = "config"


class LayoutMismatchError(KVTransferError):
    """The two sides' KV layouts disagree on `field` (local value vs remote value)."""

    code = "layout_mismatch"

    def __init__(self, field: str, local: object, remote: object, *, peer: str | None = None) -> None:
        super().__init__(
            f"KV layout mismatch on {field}: this side has {local}, the peer has {remote}; "
            "start both workers with the same model and --page-size / dtype",
            peer=peer,
        )
        self.field = field
        self.local = local
        self.remote = remote


class DuplicateRoomError(KVTransferError):
    code = "duplicate_room"


class UnknownRoomError(KVTransferError):
    code = "unknown_room"


class UnknownPeerError(KVTransferError):
    """The prefill side does not know this decode manager (never registered, or declared dead)."""

    code = "unknown_peer"


class PageIndexError(KVTransferError):
    """A page index is outside the pool, or more pages were sent than the receiver reserved."""

    code = "page_out_of_range"


class InvalidRoomError(KVTransferError):
    """A room id outside [0, 2**63) or an operation the room's state does not allow."""

    code = "invalid_room"


class PeerUnreachableError(KVTransferError):
    code = "peer_unreachable"


class TransportMismatchError(KVTransferError):
    """The two sides have no transport in common (e.g. shm asked for across hosts)."""

    code = "transport_mismatch"


class TransferIOError(KVTransferError):
    """A transport call failed; `rc` is the backend's return code (Mooncake: negative int)."""

    code = "transfer_io"

    def __init__(self, message: str, *, rc: int, room: int | None = None, peer: str | None = None) -> None:
        super().__init__(f"{message} (rc={rc}, room={room}, peer={peer})", room=room, peer=peer)
        self.rc = rc


_BY_CODE: dict[str, type[KVTransferError]] = {
    cls.code: cls
    for cls in (
        KVTransferError, ConfigError, DuplicateRoomError, UnknownRoomError, UnknownPeerError,
        PageIndexError, InvalidRoomError, PeerUnreachableError, TransportMismatchError,
    )
}


def error_from_wire(
    code: str, message: str, field: str = "", local: str = "", remote: str = "", *, peer: str | None = None
) -> KVTransferError:
    """Rebuild a typed error from its handshake form. `local`/`remote` are from the sender's view."""
    if code == LayoutMismatchError.code:
        # The server reported (its value, our value); flip to this side's point of view.
        return LayoutMismatchError(field, remote, local, peer=peer)
    cls = _BY_CODE.get(code, KVTransferError)
    return cls(f"{message} (from peer {peer})" if peer else message, peer=peer)
