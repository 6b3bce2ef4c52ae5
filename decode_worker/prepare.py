"""A decode worker's request preparation: each engine request of a PD body gets its room and the prefill worker's
bootstrap address (kv_transfer/wire/room_ids.py), which must be one this worker may dial (decode_worker/allow.py)."""
from __future__ import annotations

from collections.abc import Callable

from decode_worker.allow import PrefillAllowList
from engine.request import KVTicket, Request
from engine.sampling_params import InvalidRequestError
from engine.server.protocol import MAX_N, RoutingFields
from kv_transfer import BootstrapFieldError, peer_address, room_id


def preparer(allow: PrefillAllowList) -> Callable[[Request, RoutingFields, int, int], None]:
    def prepare(req: Request, body: RoutingFields, prompt_index: int, choice: int) -> None:
        try:
            host, port = peer_address(body.bootstrap_host, body.bootstrap_port, prompt_index)
            room = room_id(body.bootstrap_room, prompt_index, choice, MAX_N)
        except BootstrapFieldError as e:
            if e.missing:
                raise InvalidRequestError(f"this is a decode worker: {e}", param=e.field,
                                          code="missing_bootstrap") from None
            raise InvalidRequestError(str(e), param=e.field) from None
        allow.check(host, port, req.rid)
        req.kv_ticket = KVTicket(room, host, port)
    return prepare
