"""Build argparse parsers from frozen config dataclasses, so each default lives in one place; every command line
of the project (workers, router front, launchers, benchmarks, kv_transfer) is built with these two functions.

A field becomes ``--field-name`` (``--prefix-field-name`` with a prefix; its parsed value then sits under
``prefix_field_name``). Metadata keys: ``help`` (required for the flag's text), ``choices``, ``nargs``,
``flag`` (a flag name of its own, prefix or not), and ``cli=False`` to keep a field off the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _dest(name: str, prefix: str) -> str:
    return f"{prefix}_{name}" if prefix else name


def _flag(f: dataclasses.Field, prefix: str) -> str:
    return f.metadata.get("flag") or "--" + _dest(f.name, prefix).replace("_", "-")


def flag_of(cls: type, name: str, prefix: str = "") -> str:
    """The command-line flag of field ``name`` of ``cls``."""
    return _flag(next(f for f in dataclasses.fields(cls) if f.name == name), prefix)  # type: ignore[arg-type]


def _base_type(tp: Any) -> Any:
    """Strip Optional[...] and return the underlying type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _base_type(args[0])
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, group: str | None = None, prefix: str = "") -> None:
    """Add one flag per field of the dataclass ``cls`` to ``parser``."""
    target: Any = parser.add_argument_group(group) if group else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        kwargs: dict[str, Any] = {"dest": _dest(f.name, prefix), "default": default, "help": f.metadata.get("help", "")}
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
        target.add_argument(_flag(f, prefix), **kwargs)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, prefix: str = "", **overrides: Any) -> T:
    """Instantiate ``cls`` from the parsed flags that belong to it."""
    values = {f.name: getattr(args, _dest(f.name, prefix)) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if f.metadata.get("cli", True) and hasattr(args, _dest(f.name, prefix))}
    values.update(overrides)
    if hasattr(cls, "__dataclass_fields__"):
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if (typing.get_origin(_base_type(typing.get_type_hints(cls)[f.name])) is tuple
                    and isinstance(values.get(f.name), list)):
                values[f.name] = tuple(values[f.name])
    return cls(**values)
