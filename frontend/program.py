"""``@function`` programs and how they run: ``run`` (one state, returned when every call finished) and
``run_batch`` (many argument sets on a thread pool, results in input order, an optional progress bar)."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from frontend.backend import Endpoint
from frontend.state import ProgramState


class Program:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *, backend: Endpoint, **kwargs: Any) -> ProgramState:
        s = ProgramState(backend)
        self.fn(s, **kwargs)
        s.sync()
        return s

    def run_batch(self, batch: list[dict[str, Any]], *, backend: Endpoint, num_threads: int = 8,
                  progress_bar: bool = False) -> list[ProgramState]:
        done = 0

        def one(kwargs: dict[str, Any]) -> ProgramState:
            nonlocal done
            s = self.run(backend=backend, **kwargs)
            done += 1
            if progress_bar:
                print(f"\r{self.__name__}: {done}/{len(batch)}", end="" if done < len(batch) else "\n",
                      file=sys.stderr, flush=True)
            return s

        with ThreadPoolExecutor(max(1, num_threads)) as pool:
            return list(pool.map(one, batch))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Program:
    """Make ``fn(s, **args)`` a program."""
    return Program(fn)
