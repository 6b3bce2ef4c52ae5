"""Seeded random JSON schemas of the kinds structured-output clients send: nested objects with required and
optional fields, arrays with item bounds, enums, integer and number ranges, strings with patterns or lengths,
nullable unions. ``random_schema(seed)`` is deterministic; tests use many seeds, never one hand-tuned schema."""
from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "age", "city", "items", "score", "tags", "owner", "status", "price", "count", "email", "level",
         "title", "notes", "color", "size", "id", "kind", "rating", "active"]
PATTERNS = [r"^[A-Z][a-z]{1,8}$", r"^[0-9]{3}-[0-9]{4}$", r"^[a-z]+(_[a-z]+)?$", r"^#[0-9a-f]{6}$"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum", "pattern", "null_union"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(4, 24)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":
        lo = round(rng.uniform(-10, 10), 2)
        return {"type": "number", "minimum": lo, "maximum": round(lo + rng.uniform(0.5, 100), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", 1, 2, None], 3)}
    return {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return _object(rng, depth - 1)
    if depth > 0 and roll < 0.5:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(WORDS, rng.randint(1, 4))
    props = {k: _node(rng, depth) for k in keys}
    required = [k for k in keys if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def random_schema(seed: int, depth: int = 2) -> dict[str, Any]:
    return _object(random.Random(seed), depth)


def ascii_tokens(hf_tokenizer: Any, vocab_size: int) -> Any:
    """A bool array over the vocabulary: tokens whose bytes are all ASCII (see random_walk)."""
    import numpy as np
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
    return np.array([all(b < 0x80 for b in piece) for piece in info.decoded_vocab[:vocab_size]])


def random_walk(grammar: Any, vocab_size: int, stop_token: int, rng: Any, limit: int = 300,
                only: Any = None) -> list[int] | None:
    """Tokens of one random path through a compiled grammar (engine.grammar.compiler.Grammar) (uniform over the allowed tokens, the stop token
    taken with probability 1/2 whenever allowed), ending at the stop token; None if ``limit`` tokens pass first.
    Every path a grammar allows must satisfy the constraint it was compiled from. ``only`` (a bool array over
    the vocabulary, e.g. ascii_tokens) limits the walk further: xgrammar 0.2.9 admits UTF-8-encoded surrogates
    (bytes ED A0..BF) inside strings, which a walk over single-byte tokens finds and a trained model does not
    write."""
    import numpy as np
    import xgrammar as xgr

    from engine.grammar.state import GrammarState
    state = GrammarState(grammar, (stop_token,))  # the engine's own mask, JSON's control-byte filter included
    matcher = state.matcher
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    out: list[int] = []
    for _ in range(limit):
        state.fill(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
        if only is not None:
            bits[:] &= only | (np.arange(vocab_size) == stop_token)
        allowed = np.flatnonzero(bits)
        assert len(allowed), f"the grammar allows no token after {out}"
        token = stop_token if stop_token in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return out
        out.append(token)
    return None
