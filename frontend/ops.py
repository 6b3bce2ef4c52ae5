"""The calls a program adds to its state: ``gen`` (generate into a named variable, with the sampling and
constraint fields of /generate) and ``select`` (pick one of several continuations by log-probability). Each
records the program line that made it, so an error can name it."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from frontend.errors import UnsupportedError


class Seq(tuple):
    """Text and calls joined with ``+`` (``"Answer: " + gen("a")``), added to a state in order."""

    def __add__(self, other: object) -> Seq:
        return Seq((*self, *_parts(other)))

    def __radd__(self, other: object) -> Seq:
        return Seq((*_parts(other), *self))


def _parts(x: object) -> tuple[object, ...]:
    if isinstance(x, Seq):
        return tuple(x)
    if isinstance(x, (str, Gen, Select)):
        return (x,)
    raise TypeError(f"only text, gen() and select() can be joined with +, got {type(x).__name__}")


class _Joinable:
    def __add__(self, other: object) -> Seq:
        return Seq((self, *_parts(other)))

    def __radd__(self, other: object) -> Seq:
        return Seq((*_parts(other), self))


def call_site(depth: int = 2) -> str:
    """``file:line`` of the program code that called a primitive."""
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@dataclass(frozen=True)
class Gen(_Joinable):
    name: str
    params: dict[str, Any]
    site: str


@dataclass(frozen=True)
class Select(_Joinable):
    name: str
    choices: tuple[str, ...]
    normalize: bool
    site: str


@dataclass(frozen=True)
class Text:
    text: str
    site: str


@dataclass(frozen=True)
class Role:
    role: str
    begin: bool
    site: str = field(default="")


_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
             "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "regex", "ebnf")


def gen(name: str, *, max_tokens: int = 128, stop: str | list[str] | None = None, temperature: float = 0.0,
        regex: str | None = None, json_schema: dict[str, Any] | str | None = None, **sampling: Any) -> Gen:
    """Generate from the state so far into ``s[name]``. ``sampling`` takes the other /generate fields (top_p,
    top_k, min_p, seed, the penalties, stop_token_ids, ignore_eos, ebnf); an unknown one is refused here."""
    unknown = set(sampling) - set(_SAMPLING)
    if unknown:
        raise TypeError(f"gen() got unknown sampling fields {sorted(unknown)}; known: {', '.join(_SAMPLING)}")
    params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature, **sampling}
    if "seed" in params:
        params["sampling_seed"] = params.pop("seed")
    if stop is not None:
        params["stop"] = stop
    if regex is not None:
        params["regex"] = regex
    if json_schema is not None:
        import json
        params["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    return Gen(name, params, call_site())


def select(name: str, choices: list[str], *, normalize: bool = False) -> Select:
    """Continue with the choice the model finds most likely (total log-probability of its tokens, or the mean
    with ``normalize``) and store it in ``s[name]``."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select() needs a list of non-empty strings")
    return Select(name, tuple(choices), normalize, call_site())


def image(path: str) -> None:
    """Images are not supported: SplitServe serves text models."""
    raise UnsupportedError(f"{call_site()}: image({path!r}): this frontend and SplitServe serve text only")
