"""``@function`` programs and how they run: ``run`` (one state, returned when every call finished), ``stream``
(its text as it comes), ``run_batch`` (many argument sets on a thread pool, results in input order, an optional
progress bar) and ``trace`` (the graph of its calls and forks, without running it)."""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
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

    def stream(self, *, backend: Endpoint, **kwargs: Any) -> Iterator[str]:
        """The program's text as it is appended and generated (forks' text is not in it: only what reaches
        the main state); an error is raised from the iterator."""
        s = ProgramState(backend, stream=True)
        failure: list[BaseException] = []

        def body() -> None:
            try:
                self.fn(s, **kwargs)
                s.sync()
            except BaseException as e:  # noqa: BLE001 - re-raised by the consuming iterator
                failure.append(e)
            finally:
                s.end_stream()

        threading.Thread(target=body, name="program-stream", daemon=True).start()
        yield from s.events()
        if failure:
            raise failure[0]

    def trace(self, **kwargs: Any) -> list[dict[str, Any]]:
        """The program's calls and forks, without running it: one node per text, role, gen, select and fork,
        with the node it follows (variables read while tracing are placeholders, ``<name>``)."""
        from frontend.trace import TraceState
        s = TraceState()
        self.fn(s, **kwargs)
        return s.nodes

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
