"""Build argparse parsers from frozen config dataclasses, so each default lives in one place.

A field becomes ``--field-name``. Metadata keys: ``help`` (required for the flag's text),
``choices``, ``nargs``, and ``cli=False`` to keep a field off the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """Strip Optional[...] and return the underlying type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _base_type(args[0])
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, group: str | None = None) -> None:
    """Add one flag per field of the dataclass ``cls`` to ``parser``."""
    target: Any = parser.add_argument_group(group) if group else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata.get("help", "")}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if typing.get_origin(tp) in (list, tuple):
                (elem,) = typing.get_args(tp)[:1]
                kwargs["type"] = elem
                kwargs["nargs"] = f.metadata.get("nargs", "+")
            else:
                kwargs["type"] = tp
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        if kwargs["help"] and default is not None and tp is not bool:
            kwargs["help"] += " (default: %(default)s)"
        target.add_argument(_flag(f.name), **kwargs)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Instantiate ``cls`` from the parsed flags that belong to it."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if f.metadata.get("cli", True) and hasattr(args, f.name)}
    values.update(overrides)
    if hasattr(cls, "__dataclass_fields__"):
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if (typing.get_origin(_base_type(typing.get_type_hints(cls)[f.name])) is tuple
                    and isinstance(values.get(f.name), list)):
                values[f.name] = tuple(values[f.name])
    return cls(**values)
