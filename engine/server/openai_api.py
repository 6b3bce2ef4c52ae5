"""/v1/completions and /v1/chat/completions, streamed (SSE ending in ``data: [DONE]``) and not.

A streamed choice gets a chunk for every engine step that gave it tokens, as /generate, vLLM and SGLang stream,
even when none of their text is complete yet (its text then empty: part of a UTF-8 character, a tail held back
because it could become a stop string, a token with no text): so a client's time to first token and between
tokens counts tokens, not characters. Skipping such chunks put a random-weight model's first chunk (most of its
32,000 ids have no text in its 4,096-token tokenizer) several decode steps after its first token."""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.request import Request
from engine.sampler import TokenLogprob
from engine.sampling_params import InvalidRequestError
from engine.server.errors import APIError, sse_error, sse_guarded
from engine.server import tools as tools_mod
from engine.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, StreamOptions
from engine.server.serving import (ServingContext, abort_error, build_requests, collect, compile_grammar,
                                   prompt_from_chat, prompt_from_text, request_id, start_stream, usage)
from engine.server.tools import ToolFormat
from engine.step_output import StepOutput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _ChunkUsage:
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk's ``usage`` is its choice's prompt and the
    tokens streamed for it so far, counting the chunk's own (a ``{}`` to merge in when not asked for)."""

    def __init__(self, reqs: list[Request], on: bool) -> None:
        self.on = on
        self.sent = {r.rid: 0 for r in reqs}

    def __call__(self, req: Request, new: int = 0) -> dict:
        if not self.on:
            return {}
        self.sent[req.rid] += new
        prompt, done = len(req.prompt_ids), self.sent[req.rid]
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}


async def _completion_prompts(ctx: ServingContext, prompt: object) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await prompt_from_text(ctx, prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt, list) and prompt:
        return [await prompt_from_text(ctx, p, f"prompt.{i}") if isinstance(p, str) else list(p)  # type: ignore[arg-type]
                for i, p in enumerate(prompt)]
    raise InvalidRequestError("prompt must be a non-empty string, list of strings, or list of token ids",
                              param="prompt")


def _legacy_logprobs(ctx: ServingContext, lps: list[TokenLogprob], offset: int) -> dict:
    tok = ctx.core.tokenizer
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text = tok.token_text(lp.token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({tok.token_text(t): v for t, v in lp.top} if lp.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(ctx: ServingContext, lps: list[TokenLogprob]) -> dict:
    tok = ctx.core.tokenizer

    def entry(t: int, v: float) -> dict:
        text = tok.token_text(t)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _finish_reason(req: Request) -> str | None:
    return req.finish_reason if req.finish_reason in ("stop", "length") else None


async def create_completion(body: CompletionRequest, http: HTTPRequest, ctx: ServingContext):  # noqa: ANN201
    ctx.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported", "unsupported_parameter", "suffix")
    score_only = body.echo and body.max_tokens == 0  # lm-eval's loglikelihood: the prompt's logprobs, no output
    best_of = body.best_of if body.best_of is not None else body.n
    if not body.n <= best_of <= MAX_N:
        raise APIError(400, f"best_of={best_of} must be at least n={body.n} and at most {MAX_N}",
                       "invalid_request", "best_of")
    if best_of > body.n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed (the best candidates are known only at the end)",
                       "invalid_request", "best_of")
    prompts = await _completion_prompts(ctx, body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    # best_of ranks candidates by cumulative logprob, so those are computed even when the client did not ask
    params = body.sampling_params(1 if score_only else max_tokens,
                                  body.logprobs if body.logprobs is not None or best_of == body.n else 0)
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    rid = request_id(http, body, "cmpl")
    candidates = build_requests(ctx, prompts, params, best_of, rid, body, await compile_grammar(ctx, params))
    reqs = candidates
    index = {r.rid: i for i, r in enumerate(reqs)}
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.core.served_model_name}
    if body.stream:
        echo = {r.rid: _Echo(body.prompt, prompts.index(r.prompt_ids), body.logprobs is not None, score_only)
                for r in reqs} if body.echo else {}
        outs = await start_stream(http, ctx, reqs)
        events = _stream_completion(ctx, outs, reqs, index, base, body.stream_opts, echo)
        return StreamingResponse(sse_guarded(events), media_type="text/event-stream", headers=SSE_HEADERS)
    await collect(http, ctx, candidates)
    if best_of > body.n:
        reqs = best_candidates(candidates, best_of, body.n)
        index = {r.rid: i for i, r in enumerate(reqs)}
    # with score_only, the one token computed to finish the prefill is not part of the answer
    choices = [{"index": index[r.rid], "text": "" if score_only else r.detok.text,
                "logprobs": _legacy_logprobs(ctx, [] if score_only else r.output_logprobs, 0)
                if body.logprobs is not None else None,
                "finish_reason": "length" if score_only else _finish_reason(r)} for r in reqs]
    if body.echo:
        for choice, r in zip(choices, reqs):
            _Echo(body.prompt, prompts.index(r.prompt_ids), body.logprobs is not None, score_only).prefix(
                ctx, choice, r)
    counts = usage(candidates)  # every candidate's tokens count
    if score_only:
        counts.update(completion_tokens=0, total_tokens=counts["prompt_tokens"])
    return JSONResponse({**base, "choices": choices, "usage": counts})


@dataclasses.dataclass(frozen=True)
class _Echo:
    """What ``echo`` puts before a choice: the prompt as the client gave it and, with logprobs, its tokens and
    their logprobs (the first token has none). ``score_only``: max_tokens 0, the one token computed is hidden."""
    raw: object
    prompt_index: int
    logprobs: bool
    score_only: bool

    def parts(self, ctx: ServingContext, req: Request) -> tuple[str, dict | None]:
        raw = self.raw
        given = raw if isinstance(raw, str) else raw[self.prompt_index] if isinstance(raw, list) and not all(
            isinstance(x, int) for x in raw) else None
        text = given if isinstance(given, str) else ctx.core.tokenizer.decode(req.prompt_ids,
                                                                               skip_special_tokens=False)
        if not self.logprobs:
            return text, None
        prompt = _legacy_logprobs(ctx, [TokenLogprob(req.prompt_ids[0], 0.0, [])] + req.prompt_logprobs, 0)
        prompt["token_logprobs"][0] = None
        prompt["top_logprobs"][0] = None
        return text, prompt

    def prefix(self, ctx: ServingContext, choice: dict, req: Request) -> None:
        """Prefix the echo to a whole (non-streamed) choice."""
        text, prompt = self.parts(ctx, req)
        choice["text"] = text + choice["text"]
        if prompt is None:
            return
        out = choice["logprobs"]
        shift = len("".join(prompt["tokens"]))
        choice["logprobs"] = {k: prompt[k] + ([o + shift for o in out[k]] if k == "text_offset" else out[k])
                              for k in prompt}


def best_candidates(candidates: list[Request], best_of: int, n: int) -> list[Request]:
    """Per prompt (candidates come grouped by prompt), the n candidates with the highest cumulative logprob."""
    kept: list[Request] = []
    for start in range(0, len(candidates), best_of):
        group = candidates[start:start + best_of]
        kept += sorted(group, key=lambda r: -sum(lp.logprob for lp in r.output_logprobs))[:n]
    return kept


async def _stream_completion(ctx: ServingContext, outs: AsyncIterator[StepOutput], reqs: list[Request],
                             index: dict[str, int], base: dict, opts: StreamOptions,
                             echo: dict[str, _Echo]) -> AsyncIterator[str]:
    """With ``echo``, a request's first chunk is its prompt (and the prompt's logprobs), sent as soon as the
    first token is known, since that is when the prompt's logprobs are."""
    offsets = {r.rid: 0 for r in reqs}
    counted = _ChunkUsage(reqs, opts.continuous_usage_stats)
    echoed: set[str] = set()
    async for out in outs:
        err = abort_error(out.req)
        if err is not None:
            yield sse_error(err.status, err.message, err.code)
            return
        rid = out.req.rid
        if rid in echo and rid not in echoed and out.req.output_ids:  # the prompt is computed
            echoed.add(rid)
            text, prompt = echo[rid].parts(ctx, out.req)
            offsets[rid] = len("".join(prompt["tokens"])) if prompt is not None else len(text)
            yield _sse({**base, "choices": [{"index": index[rid], "text": text, "logprobs": prompt,
                                             "finish_reason": None}], **counted(out.req)})
        score_only = rid in echo and echo[rid].score_only
        if not out.new_token_ids and not out.new_text and not out.finished:
            continue
        text, lps = ("", []) if score_only else (out.new_text, out.logprobs)
        choice = {"index": index[rid], "text": text,
                  "logprobs": _legacy_logprobs(ctx, lps, offsets[rid]) if out.req.sampling.logprobs
                  is not None else None,
                  "finish_reason": ("length" if score_only else _finish_reason(out.req)) if out.finished else None}
        offsets[rid] += len(text)
        yield _sse({**base, "choices": [choice], **counted(out.req, 0 if score_only else len(out.new_token_ids))})
    if opts.include_usage:
        counts = usage(reqs)
        if any(e.score_only for e in echo.values()):
            counts.update(completion_tokens=0, total_tokens=counts["prompt_tokens"])
        yield _sse({**base, "choices": [], "usage": counts})
    yield "data: [DONE]\n\n"


async def create_chat_completion(body: ChatCompletionRequest, http: HTTPRequest, ctx: ServingContext):  # noqa: ANN201
    ctx.check_model(body.model)
    if not body.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    tok = ctx.core.tokenizer
    fmt, tools, messages, native_tools = tools_mod.chat_inputs(
        [m.as_template_dict() for m in body.messages], body.tools, ctx.core.cfg.grammar.tool_call_parser,
        getattr(tok.hf, "chat_template", None), tok.renders_tools)
    mode, allowed = tools_mod.chosen(tools, body.tool_choice)
    if mode != "none" and fmt is None:
        raise InvalidRequestError(f"tool_choice={mode!r} needs a --tool-call-parser to read calls back",
                                  param="tool_choice", code="unsupported_parameter")
    ids = await prompt_from_chat(ctx, messages, body.add_generation_prompt, native_tools)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(max_tokens, logprobs)
    calls = None
    if mode != "none":
        assert fmt is not None
        if params.grammar is not None:
            raise InvalidRequestError(f"tool_choice={mode!r} constrains the output itself; it cannot be combined "
                                      f"with {params.grammar.param}", param=params.grammar.param)
        params = dataclasses.replace(params, grammar=tools_mod.grammar_for(fmt, mode, allowed,
                                                                           body.parallel_tool_calls))
        calls = (fmt, {t.name for t in allowed})
    rid = request_id(http, body, "chatcmpl")
    reqs = build_requests(ctx, [ids], params, body.n, rid, body, await compile_grammar(ctx, params))
    index = {r.rid: i for i, r in enumerate(reqs)}
    base = {"id": rid, "created": int(time.time()), "model": ctx.core.served_model_name}
    if body.stream:
        outs = await start_stream(http, ctx, reqs)
        events = _stream_chat(ctx, outs, reqs, index, base, body.stream_opts, calls)
        return StreamingResponse(sse_guarded(events),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    await collect(http, ctx, reqs)
    choices = [{"index": index[r.rid], **_message(r, calls),
                "logprobs": _chat_logprobs(ctx, r.output_logprobs) if logprobs is not None else None}
               for r in reqs]
    return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": usage(reqs)})


def _message(req: Request, calls: tuple[ToolFormat, set[str]] | None) -> dict:
    """A whole choice's message and finish reason, with the tool calls read out of its text."""
    text = req.detok.text
    if calls is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": _finish_reason(req)}
    content, found = tools_mod.extract_calls(text, *calls)
    reason = _finish_reason(req)
    message: dict = {"role": "assistant", "content": content if content.strip() else None}
    if found:
        message["tool_calls"] = [c.as_dict() for c in found]
        reason = "tool_calls" if reason == "stop" else reason
    return {"message": message, "finish_reason": reason}


async def _stream_chat(ctx: ServingContext, outs: AsyncIterator[StepOutput], reqs: list[Request],
                       index: dict[str, int], base: dict, opts: StreamOptions,
                       calls: tuple[ToolFormat, set[str]] | None = None) -> AsyncIterator[str]:
    """With ``calls``, each choice's text goes through a CallStream: content streams as it comes, a tool call is
    sent whole (id, name and arguments in one delta) once its text is complete."""
    base = {**base, "object": "chat.completion.chunk"}
    streams = {r.rid: tools_mod.CallStream(*calls) for r in reqs} if calls is not None else {}
    counted = _ChunkUsage(reqs, opts.continuous_usage_stats)
    for r in reqs:
        yield _sse({**base, "choices": [{"index": index[r.rid], "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **counted(r)})
    async for out in outs:
        err = abort_error(out.req)
        if err is not None:
            yield sse_error(err.status, err.message, err.code)
            return
        if not out.new_token_ids and not out.new_text and not out.finished:
            continue
        reason = _finish_reason(out.req) if out.finished else None
        text, found = out.new_text, []
        stream = streams.get(out.req.rid)
        if stream is not None:
            text, found = stream.feed(out.new_text, final=out.finished)
            if reason == "stop" and stream.calls:
                reason = "tool_calls"
        delta: dict = {"content": text} if text or stream is None else {}
        if found:
            first = stream.calls - len(found)  # type: ignore[union-attr]
            delta["tool_calls"] = [{"index": first + k, **c.as_dict()} for k, c in enumerate(found)]
        choice = {"index": index[out.req.rid], "delta": delta,
                  "logprobs": _chat_logprobs(ctx, out.logprobs) if out.req.sampling.logprobs is not None
                  else None,
                  "finish_reason": reason}
        yield _sse({**base, "choices": [choice], **counted(out.req, len(out.new_token_ids))})
    if opts.include_usage:
        yield _sse({**base, "choices": [], "usage": usage(reqs)})
    yield "data: [DONE]\n\n"
