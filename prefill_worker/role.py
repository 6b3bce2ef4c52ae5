"""PrefillRole: the engine hooks of a prefill worker.

Every PD request is prefill-only (its first token ends it) and keeps its pages (``hold_kv``) until its room's
transfer is over. After each step the role pushes the pages finished so far, in prompt order, skipping the
pages the decode side already holds; the last push carries the first token and the cached-token count. The
request's HTTP stream ends (success, or an error) only when the room reaches Success or Failed; then its
pages go back, whole ones into the radix cache."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.engine_core import EngineCore
from engine.request import Abort, Request
from engine.role import EngineRole
from engine.sampling_params import InvalidRequestError
from engine.sampler import pack_logprobs
from engine.scheduler import ScheduledBatch
from engine.step_output import StepOutput
from kv_transfer import KVSender, KVTransferError, PrefillTransferManager, RoomState

log = logging.getLogger("prefill_worker")


@dataclass
class Outgoing:
    req: Request
    sender: KVSender
    start_page: int | None = None  # first prompt page the decode side lacks
    sent: int = 0  # pages queued so far (counted within the decode side's list)
    last_sent: bool = False


class PrefillRole(EngineRole):
    name = "prefill"

    def __init__(self, manager: PrefillTransferManager, worker: str) -> None:
        self.manager = manager
        self.worker = worker
        self.rooms: dict[str, Outgoing] = {}

    def add(self, core: EngineCore, req: Request) -> None:
        if req.kv_ticket is None:  # a local request (e.g. /health_generate): computed here in full
            core.queue(req)
            return
        room = req.kv_ticket.id
        try:
            sender = self.manager.create_sender(room)
        except KVTransferError as e:
            raise InvalidRequestError(f"room {room}: {e}", param="bootstrap_room") from e
        self.rooms[req.rid] = Outgoing(req, sender)
        log.debug("room opened request_id=%s room=%d worker=%s", req.rid, room, self.worker)
        core.queue_held(req)  # prompt and first token here; the decode worker samples the rest

    def after_step(self, core: EngineCore, batch: ScheduledBatch | None) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for rid, out in list(self.rooms.items()):
            state = out.sender.poll()
            if state in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING) and not out.last_sent:
                try:
                    self._push(core, out)
                except (KVTransferError, InvalidRequestError) as e:
                    out.sender.abort(str(e))
                state = out.sender.poll()
            if state == RoomState.SUCCESS:
                outputs.append(self._close(core, out, None))
            elif state == RoomState.FAILED:
                outputs.append(self._close(core, out, out.sender.failure_reason or "KV transfer failed"))
        return outputs

    def _push(self, core: EngineCore, out: Outgoing) -> None:
        req, sender = out.req, out.sender
        page = core.kv_shape.page_size
        prompt_pages = -(-len(req.prompt_ids) // page)
        dst = sender.dst_pages
        assert dst is not None and sender.held_prefix_tokens is not None
        if out.start_page is None:
            out.start_page = sender.held_prefix_tokens // page
            if out.start_page + len(dst) != prompt_pages:
                raise InvalidRequestError(
                    f"the decode worker reserved {len(dst)} pages after {sender.held_prefix_tokens} held tokens, "
                    f"but this prompt has {len(req.prompt_ids)} tokens ({prompt_pages} pages of {page}): the two "
                    f"workers tokenized the request differently")
        ready = (prompt_pages if req.prefill_done else min(req.kv_len // page, prompt_pages)) - out.start_page
        if not req.prefill_done and ready <= out.sent:
            return  # nothing new finished since the last push
        pages = req.pages[out.start_page + out.sent:out.start_page + ready]
        if req.prefill_done:  # the whole prompt is computed: the rest, the first token and the aux record
            logprobs = req.output_logprobs[0].pack() if req.output_logprobs else b""
            prompt_lps = pack_logprobs(req.prompt_logprobs) if req.sampling.prompt_logprobs is not None else b""
            sender.send(pages, last=True, first_token_id=req.output_ids[0], cached_tokens=req.cached_tokens or 0,
                        aux_payload=logprobs, extra_payload=prompt_lps)
        else:
            sender.send(pages)
        out.sent, out.last_sent = ready, req.prefill_done

    def _close(self, core: EngineCore, out: Outgoing, failure: str | None) -> StepOutput:
        """The room is over: end the HTTP stream and give the pages back."""
        req = out.req
        del self.rooms[req.rid]
        if failure is not None:
            core.end(req, Abort(502, f"KV transfer failed: {failure}"))
        core.release_held(req)
        out.sender.release()
        if failure is not None:
            log.warning("room failed request_id=%s room=%d worker=%s reason=%s", req.rid, out.sender.room,
                        self.worker, failure)
        return StepOutput(req, finished=True)

    def on_abort(self, core: EngineCore, req: Request) -> None:
        out = self.rooms.pop(req.rid, None)
        if out is None:
            return
        out.sender.abort(f"request {req.rid} aborted: {getattr(req.finish_detail, 'message', req.finish_detail)}")
        core.release_held(req)
        out.sender.release()

    def close(self) -> None:
        self.manager.close()
