"""What one step gives a request: its new tokens, their text and logprobs, and whether it finished.
``token_output`` turns a request's newest tokens into that, running them through the request's detokenizer and
stop strings (which may end the request, through the scheduler, inside a verified draft)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.request import Request
from engine.sampler import TokenLogprob
from engine.scheduler import Scheduler


@dataclass
class StepOutput:
    req: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    jumped: int = 0  # of new_token_ids, how many a grammar forced (jump-forward) rather than the model sampled
    drafted: int = 0  # speculative decoding: draft tokens verified this step, and how many of them were kept
    accepted: int = 0


def token_output(scheduler: Scheduler, req: Request, lps: list[TokenLogprob] | None = None, jumped: int = 0,
                 new: int = 1) -> StepOutput:
    """The output for a request's ``new`` newest sampled tokens (more than one: a verified draft) and the
    ``jumped`` tokens a grammar forced after them: timing, logprobs, incremental text, stop strings. A stop
    string inside a verified draft ends the request at the token that completes it, as decoding one token at a
    time would."""
    tokens = req.output_ids[len(req.output_ids) - new - jumped:]
    lps = lps or []
    now = time.monotonic()
    if req.first_token_time is None:
        req.first_token_time = now
    req.last_token_time = now
    text, stop = "", None
    if req.detok is not None:
        pieces = [tokens] if new == 1 or not req.detok.stop else [[t] for t in tokens]
        for used, piece in enumerate(pieces, 1):
            part, stop = req.detok.add(piece)
            text += part
            if stop is not None:
                if used < len(pieces):  # the tokens after it never happened
                    tokens, lps = tokens[:used], lps[:used]
                    scheduler.finish(req, "stop", stop, drop=len(pieces) - used)
                break
        if stop is not None and not req.finished:
            scheduler.finish(req, "stop", stop)
        elif req.finished and stop is None:
            text += req.detok.flush()
    req.output_logprobs.extend(lps)
    out = StepOutput(req, tokens, text, list(lps), jumped=jumped)
    out.finished = req.finished and not req.hold_kv  # a held request ends when its transfer does
    return out
