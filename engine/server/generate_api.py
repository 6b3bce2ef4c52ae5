"""SGLang-style ``/generate``: text or token ids in (one prompt or a batch), text and token ids out. Streamed
chunks carry the cumulative text and ids of their request (``index`` tells batch members apart)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.request import Request
from engine.sampling_params import InvalidRequestError
from engine.server.errors import sse_error, sse_guarded
from engine.server.openai_api import SSE_HEADERS
from engine.server.protocol import GenerateRequest
from engine.server.serving import (ServingContext, abort_error, build_requests, collect, compile_grammar,
                                   prompt_from_text, request_id, start_stream)
from engine.step_output import StepOutput


async def _prompts(ctx: ServingContext, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Prompts as token ids, and whether the body was a batch."""
    if body.text is not None:
        if isinstance(body.text, str):
            return [await prompt_from_text(ctx, body.text, "text")], False
        if not body.text:
            raise InvalidRequestError("text must not be an empty list", param="text")
        return [await prompt_from_text(ctx, t, f"text.{i}") for i, t in enumerate(body.text)], True
    ids = body.input_ids
    if not ids:
        raise InvalidRequestError("input_ids must not be empty", param="input_ids")
    if all(isinstance(t, int) for t in ids):
        return [list(ids)], False  # type: ignore[arg-type]
    return [list(x) for x in ids], True  # type: ignore[union-attr]


def _meta(req: Request, logprobs: bool) -> dict:
    reason = None
    if req.finish_reason in ("stop", "length"):
        reason = {"type": req.finish_reason}
        if req.finish_reason == "stop":
            reason["matched"] = req.finish_detail
    meta = {"id": req.rid, "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens or 0, "finish_reason": reason}
    if logprobs:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in req.output_logprobs]
        meta["output_top_logprobs"] = [[[v, t] for t, v in lp.top] for lp in req.output_logprobs]
    return meta


async def generate(body: GenerateRequest, http: HTTPRequest, ctx: ServingContext):  # noqa: ANN201
    prompts, batched = await _prompts(ctx, body)
    sp = body.sampling_params
    logprobs = body.top_logprobs_num if body.return_logprob else None
    params = sp.to_params(logprobs)
    reqs = build_requests(ctx, prompts, params, sp.n, request_id(http, body, "gen"), body,
                          await compile_grammar(ctx, params))
    if body.stream:
        outs = await start_stream(http, ctx, reqs)
        return StreamingResponse(sse_guarded(_stream(outs, reqs, body.return_logprob)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    await collect(http, ctx, reqs)
    results = [{"text": r.detok.text, "output_ids": r.output_ids, "meta_info": _meta(r, body.return_logprob)}
               for r in reqs]
    return JSONResponse(results if batched or len(results) > 1 else results[0])


async def _stream(outs: AsyncIterator[StepOutput], reqs: list[Request], logprobs: bool) -> AsyncIterator[str]:
    index = {r.rid: i for i, r in enumerate(reqs)}
    texts = {r.rid: "" for r in reqs}
    async for out in outs:
        err = abort_error(out.req)
        if err is not None:
            yield sse_error(err.status, err.message, err.code)
            return
        if not out.new_token_ids and not out.finished:
            continue
        texts[out.req.rid] += out.new_text
        chunk = {"index": index[out.req.rid], "text": texts[out.req.rid], "output_ids": list(out.req.output_ids),
                 "meta_info": _meta(out.req, logprobs)}
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
