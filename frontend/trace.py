"""Tracing a program without running it: a state that records each operation as a node of a graph (text, role
begin/end, gen, select, fork) and answers variable reads with placeholders."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from frontend.ops import Gen, Select, Seq


class TraceState:
    def __init__(self, nodes: list[dict[str, Any]] | None = None, last: int | None = None) -> None:
        self.nodes = nodes if nodes is not None else []
        self._last = last

    def _add(self, kind: str, **fields: Any) -> None:
        self.nodes.append({"id": len(self.nodes), "kind": kind, "after": self._last, **fields})
        self._last = len(self.nodes) - 1

    def __iadd__(self, item: Any) -> TraceState:
        for part in (item if isinstance(item, Seq) else (item,)):
            if isinstance(part, Gen):
                self._add("gen", name=part.name, params=part.params)
            elif isinstance(part, Select):
                self._add("select", name=part.name, choices=list(part.choices))
            else:
                self._add("text", text=str(part))
        return self

    @contextlib.contextmanager
    def _role(self, role: str) -> Iterator[None]:
        self._add("role", role=role, begin=True)
        yield
        self._add("role", role=role, begin=False)

    def system(self) -> contextlib.AbstractContextManager[None]:
        return self._role("system")

    def user(self) -> contextlib.AbstractContextManager[None]:
        return self._role("user")

    def assistant(self) -> contextlib.AbstractContextManager[None]:
        return self._role("assistant")

    def fork(self, n: int) -> list[TraceState]:
        self._add("fork", n=n)
        at = self._last
        return [TraceState(self.nodes, at) for _ in range(n)]

    def __getitem__(self, name: str) -> str:
        return f"<{name}>"

    def text(self) -> str:
        return ""

    def sync(self) -> None:
        return None
