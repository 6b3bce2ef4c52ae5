"""DecodeRole: the engine hooks of a decode worker.

A PD request queues until pages for its prompt can be reserved without over-committing
(``EngineCore.reserve_external``); then the role opens its room: the decode side's pages after what its own radix
cache already holds, an aux slot, and that held-prefix count go to the prefill worker. When the room succeeds the
request joins the decode batch with the first token from the aux record (and, when it asked for them, the
prompt's logprobs from the Success event: the prefill forward computed them). A failed or aborted room ends the
request with an error and its pages are quarantined for ``kv_quarantine`` seconds before they are freed."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from decode_worker.config import DecodeConfig
from engine.engine_core import EngineCore
from engine.request import Abort, Request
from engine.role import EngineRole
from engine.sampler import TokenLogprob, unpack_logprobs
from engine.step_output import StepOutput
from kv_transfer import DecodeTransferManager, KVReceiver, KVTransferError, RoomState

log = logging.getLogger("decode_worker")


@dataclass
class Incoming:
    req: Request
    receiver: KVReceiver
    slot: int


class DecodeRole(EngineRole):
    name = "decode"

    def __init__(self, manager: DecodeTransferManager, cfg: DecodeConfig, worker: str) -> None:
        self.manager = manager
        self.cfg = cfg
        self.worker = worker
        self.free_slots = list(range(cfg.max_transfer_rooms - 1, -1, -1))
        self.rooms: dict[str, Incoming] = {}
        self.quarantine: list[tuple[float, Request]] = []

    def add(self, core: EngineCore, req: Request) -> None:
        if req.kv_ticket is None:  # a local request (e.g. /health_generate): prefill it here
            core.queue(req)
        else:
            core.queue_external(req)

    def before_step(self, core: EngineCore) -> list[StepOutput]:
        outputs = self._open_rooms(core)
        for inc in list(self.rooms.values()):
            state = inc.receiver.poll()
            if state == RoomState.SUCCESS:
                outputs.append(self._activate(core, inc))
            elif state == RoomState.FAILED:
                outputs.append(self._fail(core, inc, inc.receiver.failure_reason or "KV transfer failed"))
        self._release_quarantined(core)
        return outputs

    def _open_rooms(self, core: EngineCore) -> list[StepOutput]:
        failed = []
        page = core.kv_shape.page_size
        limit = min(self.cfg.max_transfer_rooms, len(self.rooms) + len(self.free_slots))
        for req in core.reserve_external(self.cfg.decode_reserve_tokens, limit):
            ticket = req.kv_ticket
            assert ticket is not None and ticket.host is not None and ticket.port is not None
            slot = self.free_slots.pop()
            held = req.kv_len  # page-aligned prefix from this worker's own radix cache
            try:
                receiver = self.manager.create_receiver(ticket.id, ticket.host, ticket.port)
                receiver.init(req.pages[held // page:], slot, held_prefix_tokens=held)
            except KVTransferError as e:
                self.free_slots.append(slot)
                failed.append(core.end(req, Abort(409, f"room {ticket.id}: {e}")))
                self._quarantine(req, delay=0.0)  # nothing was opened, nothing can be written
                continue
            except Exception as e:  # a defect, not the peer: it fails this request alone, not the step
                log.exception("opening a room failed request_id=%s room=%d worker=%s", req.rid, ticket.id,
                              self.worker)
                self.free_slots.append(slot)
                failed.append(core.end(req, Abort(500, f"room {ticket.id}: internal error opening the room: {e}")))
                self._quarantine(req, self.cfg.kv_quarantine)  # it may have been opened: no late write lands
                continue
            self.rooms[req.rid] = Incoming(req, receiver, slot)
            log.debug("room opened request_id=%s room=%d worker=%s held=%d pages=%d", req.rid, ticket.id,
                      self.worker, held, len(req.pages) - held // page)
        return failed

    def _activate(self, core: EngineCore, inc: Incoming) -> StepOutput:
        record = inc.receiver.aux_record
        assert record is not None and record.room == inc.receiver.room
        req = inc.req
        prompt_lps = None
        if req.sampling.prompt_logprobs is not None:
            try:
                prompt_lps = unpack_logprobs(inc.receiver.extra_payload)
            except ValueError as e:
                return self._fail(core, inc, f"the prefill worker sent no usable prompt logprobs ({e})")
            if len(prompt_lps) != len(req.prompt_ids) - 1:
                return self._fail(core, inc, f"the prefill worker sent {len(prompt_lps)} prompt logprobs for "
                                             f"{len(req.prompt_ids)} prompt tokens")
        self._close_room(inc)
        first_lp = TokenLogprob.unpack(record.payload) if record.payload else None
        return core.activate(req, record.first_token_id, first_lp, cached_tokens=record.cached_tokens,
                             prompt_logprobs=prompt_lps)

    def _fail(self, core: EngineCore, inc: Incoming, reason: str) -> StepOutput:
        self._close_room(inc)
        out = core.end(inc.req, Abort(502, f"KV transfer failed: {reason}"))
        self._quarantine(inc.req, self.cfg.kv_quarantine)
        log.warning("room failed request_id=%s room=%d worker=%s reason=%s", inc.req.rid, inc.receiver.room,
                    self.worker, reason)
        return out

    def on_abort(self, core: EngineCore, req: Request) -> None:
        inc = self.rooms.get(req.rid)
        if inc is not None:
            detail = getattr(req.finish_detail, "message", req.finish_detail)
            inc.receiver.abort(f"request {req.rid} aborted: {detail}")
            self._close_room(inc)
        if core.holds(req):
            self._quarantine(req, self.cfg.kv_quarantine if inc is not None else 0.0)

    def _close_room(self, inc: Incoming) -> None:
        del self.rooms[inc.req.rid]
        self.free_slots.append(inc.slot)
        inc.receiver.release()

    def _quarantine(self, req: Request, delay: float) -> None:
        self.quarantine.append((time.monotonic() + delay, req))

    def _release_quarantined(self, core: EngineCore) -> None:
        if not self.quarantine:
            return
        now = time.monotonic()
        due = [r for t, r in self.quarantine if t <= now]
        self.quarantine = [(t, r) for t, r in self.quarantine if t > now]
        for req in due:
            core.release_held(req, keep=False)  # never cache pages a failed transfer wrote

    def close(self) -> None:
        self.manager.close()
