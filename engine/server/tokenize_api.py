"""``/tokenize`` and ``/detokenize`` in vLLM's request and response shapes: text or chat messages to the ids the
server would compute on (chat messages and tools rendered exactly as /v1/chat/completions renders them), and ids
back to text."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from engine.sampling_params import InvalidRequestError
from engine.server.protocol import DetokenizeRequest, TokenizeRequest
from engine.server.serving import ServingContext, off_loop
from engine.server.tools import chat_inputs


async def tokenize(body: TokenizeRequest, ctx: ServingContext) -> JSONResponse:
    """Long texts are tokenized off the event loop (``serving.off_loop``); their length is not bounded by the
    context, since counting a long text's tokens is what a client may want to know."""
    ctx.check_model(body.model)
    tok = ctx.core.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        _, _, messages, native_tools = chat_inputs(
            [m.as_template_dict() for m in body.messages], body.tools, ctx.core.cfg.grammar.tool_call_parser,
            getattr(tok.hf, "chat_template", None), tok.renders_tools)
        chars = sum(len(m["content"]) for m in messages)
        text = await off_loop(ctx, chars, tok.render_chat, messages, body.add_generation_prompt, native_tools)
        # vLLM's default for chat is False: the template already holds the special tokens
        ids = await off_loop(ctx, len(text), tok.encode, text, bool(body.add_special_tokens))
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await off_loop(ctx, len(body.prompt), tok.encode, body.prompt, special)
    strs = await off_loop(ctx, len(ids), lambda: [tok.token_text(t) for t in ids]) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": ctx.core.context_length, "tokens": ids,
                         "token_strs": strs})


async def detokenize(body: DetokenizeRequest, ctx: ServingContext) -> JSONResponse:
    ctx.check_model(body.model)
    vocab = ctx.core.arch.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    text = await off_loop(ctx, len(body.tokens), ctx.core.tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})
