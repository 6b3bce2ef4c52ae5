"""SplitServe router: a Rust HTTP front door (router/core) driven from Python.

`launch_router` (or `python -m router.launch_router`) starts it; `RouterArgs` is its
configuration, whose defaults come from the Rust side (`router._router.defaults_json`).
"""
from __future__ import annotations

from router.config import RouterArgs, build_parser, parse_args

__all__ = ["RouterArgs", "build_parser", "parse_args"]
