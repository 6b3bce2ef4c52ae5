"""A prefill worker's request preparation: each engine request of a PD body gets its room
(kv_transfer/wire/room_ids.py); the body's bootstrap host and port name this worker itself, so they are not
needed."""
from __future__ import annotations

from engine.request import KVTicket, Request
from engine.sampling_params import InvalidRequestError
from engine.server.protocol import MAX_N, RoutingFields
from kv_transfer import BootstrapFieldError, room_id


def prepare(req: Request, body: RoutingFields, prompt_index: int, choice: int) -> None:
    try:
        req.kv_ticket = KVTicket(room_id(body.bootstrap_room, prompt_index, choice, MAX_N))
    except BootstrapFieldError as e:
        if e.missing:
            raise InvalidRequestError(f"this is a prefill worker: {e}", param=e.field,
                                      code="missing_bootstrap") from None
        raise InvalidRequestError(str(e), param=e.field) from None
