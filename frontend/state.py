"""A program's state: the exact token ids and text so far, the variables its calls filled, and a worker thread
that runs its calls in order. ``s += x`` queues x and returns at once; reading ``s[name]`` (or the text) waits for
what was queued before. So the branches of a ``fork`` run at the same time, each on its own thread, and share
the parent's prefix ids, which the server's radix cache holds once."""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

from frontend.backend import Endpoint
from frontend.errors import FrontendError
from frontend.ops import Gen, Role, Select, Seq, Text, call_site

_DONE = object()


class ProgramState:
    def __init__(self, backend: Endpoint, ids: list[int] | None = None, text: str = "",
                 variables: dict[str, Any] | None = None, stream: bool = False) -> None:
        self.backend = backend
        self._events: queue.Queue[str | None] | None = queue.Queue() if stream else None
        self._ids = list(ids or [])
        self._text = text
        self._vars: dict[str, Any] = dict(variables or {})
        self._meta: dict[str, dict[str, Any]] = {}
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="program-state", daemon=True)
        self._thread.start()

    # -- building ----------------------------------------------------------------------------------------------
    def __iadd__(self, item: Any) -> ProgramState:
        site = call_site()
        if isinstance(item, ProgramState):
            raise FrontendError(f"{site}: add a fork's variables (s += f['name']), not the fork itself")
        for part in (item if isinstance(item, Seq) else (item,)):
            if not isinstance(part, (str, Gen, Select)):
                raise FrontendError(f"{site}: a program state takes text, gen() and select(), got "
                                    f"{type(part).__name__}")
            self._queue.put(Text(part, site) if isinstance(part, str) else part)
        return self

    @contextlib.contextmanager
    def _role(self, role: str, site: str) -> Iterator[None]:
        self._queue.put(Role(role, True, site))
        yield
        self._queue.put(Role(role, False, site))

    def system(self) -> contextlib.AbstractContextManager[None]:
        """``with s.system(): s += ...``: a system message, in the served model's chat template."""
        return self._role("system", call_site())

    def user(self) -> contextlib.AbstractContextManager[None]:
        return self._role("user", call_site())

    def assistant(self) -> contextlib.AbstractContextManager[None]:
        return self._role("assistant", call_site())

    def fork(self, n: int) -> list[ProgramState]:
        """``n`` branches that start from this state (its calls so far done) and run in parallel. With more
        than one, the shared prefix is computed once first (a one-token request), so the branches, arriving
        together, all find it in the server's cache instead of each computing it."""
        site = call_site()
        self.sync()
        if n > 1 and self._ids and self.backend.token_exact:
            self.backend.generate(self._ids, {"max_new_tokens": 1, "temperature": 0.0}, site)
        return [ProgramState(self.backend, self._ids, self._text, self._vars) for _ in range(n)]

    # -- reading -----------------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait until every queued call has run; re-raise the first that failed."""
        done = threading.Event()
        self._queue.put((_DONE, done))
        done.wait()
        if self._error is not None:
            raise self._error

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r}; this state has {sorted(self._vars)}")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def text(self) -> str:
        self.sync()
        return self._text

    def token_ids(self) -> list[int]:
        self.sync()
        return list(self._ids)

    def meta(self, name: str) -> dict[str, Any]:
        """What the server said about the call that filled ``name`` (prompt and cached tokens, finish reason)."""
        self.sync()
        return self._meta[name]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the server found cached, summed over this state's calls."""
        self.sync()
        return sum(m.get("cached_tokens", 0) for m in self._meta.values())

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._vars)

    def events(self) -> Iterator[str]:
        """Text as it is appended and generated, until end_stream (a state made with ``stream=True``)."""
        assert self._events is not None, "this state was not made to stream"
        while (chunk := self._events.get()) is not None:
            yield chunk

    def end_stream(self) -> None:
        if self._events is not None:
            self._events.put(None)

    def _emit(self, text: str) -> None:
        if self._events is not None and text:
            self._events.put(text)

    # -- the worker --------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, tuple) and item and item[0] is _DONE:
                item[1].set()
                continue
            if self._error is not None:
                continue  # a failed call skips the rest; sync() raises it
            try:
                self._run(item)
            except BaseException as e:  # noqa: BLE001 - handed to the program at its next read
                self._error = e

    def _append_text(self, text: str, site: str) -> None:
        if text:
            self._ids += self.backend.tokenize(text, site)
            self._text += text
            self._emit(text)

    def _run(self, item: Any) -> None:
        if isinstance(item, Text):
            self._append_text(item.text, item.site)
        elif isinstance(item, Role):
            prefix, suffix = self.backend.role_markers(item.role, item.site)
            self._append_text(prefix if item.begin else suffix, item.site)
        elif isinstance(item, Gen):
            self._gen(item)
        else:
            self._select(item)

    def _gen(self, op: Gen) -> None:
        if self._events is None:
            out = self.backend.generate(self._ids, op.params, op.site, self._text)
        else:
            for kind, value in self.backend.generate_stream(self._ids, op.params, op.site, self._text):
                if kind == "text":
                    self._emit(value)
                else:
                    out = value
        meta = out["meta_info"]
        reason = meta.get("finish_reason") or {}
        matched = reason.get("matched")
        if not self.backend.token_exact:
            ids = []
        elif reason.get("type") == "stop" and isinstance(matched, str):
            ids = self.backend.tokenize(out["text"], op.site)  # the text ends before the stop string
        else:
            ids = list(out["output_ids"])
            if reason.get("type") == "stop" and ids and ids[-1] == matched:
                ids.pop()  # the end-of-turn token: a role block's end writes the template's own
        self._ids += ids
        self._text += out["text"]
        self._vars[op.name] = out["text"]
        self._meta[op.name] = meta

    def _select(self, op: Select) -> None:
        choices = [self.backend.tokenize(c, op.site) for c in op.choices]
        scores = []
        for lps in self.backend.continuation_logprobs(self._ids, choices, op.site):
            total = sum(v for v in lps if v is not None)
            scores.append(total / max(1, len(lps)) if op.normalize else total)
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        self._ids += choices[best]
        self._text += op.choices[best]
        self._emit(op.choices[best])
        self._vars[op.name] = op.choices[best]
        self._meta[op.name] = {"scores": dict(zip(op.choices, scores)), "logprob": scores[best]}
