"""``/tokenize`` and ``/detokenize`` in vLLM's request and response shapes: text or chat messages to the ids the
server would compute on, and ids back to text."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from engine.sampling_params import InvalidRequestError
from engine.server.protocol import DetokenizeRequest, TokenizeRequest
from engine.server.serving import ServingContext


def tokenize(body: TokenizeRequest, ctx: ServingContext) -> JSONResponse:
    ctx.check_model(body.model)
    tok = ctx.core.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        text = tok.render_chat([m.as_template_dict() for m in body.messages], body.add_generation_prompt)
        # vLLM's default for chat is False: the template already holds the special tokens
        ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        ids = tok.encode(body.prompt, add_special_tokens=True if body.add_special_tokens is None
                         else body.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.core.context_length, "tokens": ids,
                         "token_strs": [tok.token_text(t) for t in ids] if body.return_token_strs else None})


def detokenize(body: DetokenizeRequest, ctx: ServingContext) -> JSONResponse:
    ctx.check_model(body.model)
    vocab = ctx.core.arch.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": ctx.core.tokenizer.decode(body.tokens, skip_special_tokens=False)})
