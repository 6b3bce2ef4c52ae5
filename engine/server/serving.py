"""What every endpoint shares: the serving context, turning prompts into engine requests, running them with
client-disconnect handling, and mapping aborted requests to HTTP errors."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest

from engine.async_engine import AsyncEngine
from engine.metrics import EngineMetrics
from engine.request import Abort, Request
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.server import text_pool
from engine.server.errors import APIError
from engine.server.protocol import RoutingFields
from engine.step_output import StepOutput

DISCONNECT_POLL_S = 0.5
# Texts longer than this are tokenized (and chat templates rendered) on a worker thread, never on the event loop:
# megabytes take seconds, and the loop also serves every other request's stream and /health. Shorter ones are
# done inline, where a thread hop would cost more than the work.
INLINE_TEXT_CHARS = 4096


@dataclass
class ServingContext:
    engine: AsyncEngine
    metrics: EngineMetrics
    role: str = "colocated"
    # Role hook: checks/attaches the routing fields (PD bootstrap) to each request before it is queued;
    # called with the request, the body, the prompt's index in a batch and the choice index.
    prepare: Callable[[Request, RoutingFields, int, int], None] | None = None
    started: float = field(default_factory=time.time)

    @property
    def core(self):  # noqa: ANN201 - EngineCore; untyped to keep the import graph acyclic for workers
        return self.engine.core

    def check_model(self, name: str | None) -> None:
        served = self.core.served_model_name
        if name is not None and name not in (*self.core.served_model_names, str(self.core.source.path)):
            raise APIError(400, f"model {name!r} is not served here; this server serves {served!r}",
                           "model_not_found", "model")


def request_id(http: HTTPRequest, body: RoutingFields, prefix: str) -> str:
    """The engine's id for the request: the body's ``rid`` as given (the client promises it is unique and may
    abort by it); else the ``x-request-id`` header (which a router keeps across retries, so it gets a unique
    suffix and logs still show it); else a fresh one."""
    if body.rid:
        return body.rid
    header = http.headers.get("x-request-id")
    return f"{header}-{uuid.uuid4().hex[:8]}" if header else f"{prefix}-{uuid.uuid4().hex}"


async def compile_grammar(ctx: ServingContext, params: SamplingParams) -> object | None:
    """The compiled form of the request's grammar (None without one), from the cache or compiled on the grammar
    pool, never on the event loop or the engine thread; refused with a 400 when it does not compile within
    ``--grammar-compile-timeout``."""
    spec = params.grammar
    if spec is None:
        return None
    grammars = ctx.core.grammars
    if grammars is None:
        raise InvalidRequestError(f"{spec.param} needs constrained decoding, which this server runs without "
                                  "(--grammar-backend none)", param=spec.param, code="unsupported_parameter")
    timeout = ctx.core.cfg.grammar.grammar_compile_timeout
    try:
        compiled = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(grammars.submit(spec))), timeout)
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"{spec.param} did not compile within {timeout:g}s (--grammar-compile-timeout); "
                                  "simplify it", param=spec.param, code="grammar_timeout") from None
    ctx.metrics.grammar_compiled(compiled.seconds, compiled.hit)
    return compiled.grammar


def build_requests(ctx: ServingContext, prompts: list[list[int]], params: SamplingParams, n: int, rid: str,
                   body: RoutingFields, grammar: object | None = None) -> list[Request]:
    """One request per (prompt, choice); choices after the first share the first one's cached prompt pages.
    ``grammar``: the compiled grammar of ``params.grammar``; each request follows it with its own matcher."""
    reqs: list[Request] = []
    for p, ids in enumerate(prompts):
        leader = None
        for i in range(n):
            sub = rid if len(prompts) * n == 1 else f"{rid}-{p}-{i}"
            req = ctx.core.make_request(ids, params, rid=sub, extra_key=body.namespace, priority=body.priority,
                                        choice=i, group_leader=leader, grammar=grammar)
            if ctx.prepare is not None:
                ctx.prepare(req, body, p, i)
            leader = leader or req
            reqs.append(req)
    return reqs


def abort_error(req: Request) -> APIError | None:
    """The error a still-listening client gets for an aborted request (never a partial 200)."""
    if req.finish_reason != "abort":
        return None
    detail = req.finish_detail
    if isinstance(detail, Abort):
        return APIError(detail.status if detail.status != 499 else 500, detail.message, detail.code)
    return APIError(500, f"request aborted: {detail}", "request_aborted")


async def collect(http: HTTPRequest, ctx: ServingContext, reqs: list[Request]) -> None:
    """Run to completion (text and logprobs accumulate on the requests); if the client disconnects first,
    abort the requests and stop."""

    async def consume() -> None:
        async for _ in ctx.engine.generate(reqs):
            pass

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()  # leaving generate() aborts the requests
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "the client disconnected", "client_disconnected")
        task.result()
    except asyncio.CancelledError:  # the server is cancelling this handler (shutdown): abort and go
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    for req in reqs:
        err = abort_error(req)
        if err is not None:
            raise err


async def start_stream(http: HTTPRequest, ctx: ServingContext, reqs: list[Request]) -> AsyncIterator[StepOutput]:
    """Wait for the first output before a streamed response commits to status 200, so a request that fails
    before producing anything (a refused or failed KV transfer, say) gets a real error status; then return
    the outputs as they come (the caller turns a later abort into an SSE error event)."""
    agen = ctx.engine.generate(reqs)
    task = asyncio.ensure_future(agen.__anext__())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await agen.aclose()
            raise APIError(499, "the client disconnected", "client_disconnected")
    first = task.result()
    err = abort_error(first.req) if first.finished else None
    if err is not None:
        await agen.aclose()
        raise err

    async def outputs() -> AsyncIterator[StepOutput]:
        yield first
        async for out in agen:
            yield out
    return outputs()


def usage(reqs: list[Request]) -> dict:
    """OpenAI usage; a prompt shared by n choices counts once."""
    leaders = [r for r in reqs if r.group_leader is None]
    prompt = sum(len(r.prompt_ids) for r in leaders)
    completion = sum(len(r.output_ids) for r in reqs)
    cached = sum(r.cached_tokens or 0 for r in leaders)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def check_text_fits(ctx: ServingContext, chars: int, param: str) -> None:
    """Refuse text that cannot fit the context, from its length alone (``Tokenizer.fewest_tokens``)."""
    fewest = ctx.core.tokenizer.fewest_tokens(chars)
    if fewest > ctx.core.context_length:
        raise InvalidRequestError(
            f"{param} is {chars} characters, which is at least {fewest} tokens; this model's context length is "
            f"{ctx.core.context_length}, so shorten it", param=param, code="context_length_exceeded")


async def off_loop(ctx: ServingContext, size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), on a text thread (``text_pool``) when the text it works on is long: ``size`` characters (tokens,
    for detokenizing). Texts far larger than the context could hold (``text_pool.is_huge``) go to the huge-text
    thread, so a prompt that may well fit never queues behind them."""
    if size <= INLINE_TEXT_CHARS:
        return fn(*args)
    return await text_pool.run(text_pool.is_huge(size, ctx.core.context_length), fn, *args)


async def prompt_from_text(ctx: ServingContext, text: str, param: str = "prompt") -> list[int]:
    check_text_fits(ctx, len(text), param)
    ids = await off_loop(ctx, len(text), ctx.core.tokenizer.encode, text)
    if not ids:
        raise InvalidRequestError("the prompt is empty", param=param)
    return ids


async def prompt_from_chat(ctx: ServingContext, messages: list[dict[str, Any]], add_generation_prompt: bool,
                           tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template's rendering of ``messages`` (and ``tools``, for a template that renders them),
    tokenized (both off the loop when long)."""
    chars = sum(len(m["content"]) for m in messages)  # as_template_dict gives every message a str content
    check_text_fits(ctx, chars, "messages")
    return await off_loop(ctx, chars, ctx.core.tokenizer.apply_chat_template, messages, add_generation_prompt, tools)
