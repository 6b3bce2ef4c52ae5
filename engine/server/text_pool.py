"""Where long text work runs: tokenizing, rendering chat templates and detokenizing, off the event loop.

Two single-thread pools by size: long texts (a prompt that may fit the context, milliseconds to tokenize) and
huge ones (far more characters than the context could hold, at least ``HUGE_TEXT_CHARS``: megabytes that pass the
cheap length bound, hundreds of milliseconds each; ``is_huge``). So text work never takes more
than two cores, however many prompts arrive at once, and an ordinary long prompt never queues behind megabyte
ones. The work is CPU-bound and HF tokenizers release the GIL while they encode: with asyncio's default pool (one
thread per core plus four), ten 1 MiB prompts tokenized at once took both cores of a 2-core host from the engine
thread, and a running stream's worst gap was 401 ms (16 steps); with one thread for them it was 77 ms, against
52 ms for the same burst sent to a process that only reads it (benchmarks/bench_event_loop.py, interleaved;
docs/benchmarks.md). Lowering the threads' priority instead (``nice``) made it worse: a descheduled
text thread holding the GIL then held up the engine."""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
HUGE_TEXT_CHARS = 1 << 16
HUGE_CHARS_PER_TOKEN = 8  # English averages about 4 characters a token

_pools: dict[bool, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child inherits the pools but not their threads: it makes its own on first use."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def pool(huge: bool) -> ThreadPoolExecutor:
    """The process's pool for huge texts, or for the others; made on first use."""
    with _lock:
        if huge not in _pools:
            _pools[huge] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-huge" if huge else "text")
        return _pools[huge]


def is_huge(size: int, context_length: int) -> bool:
    """Whether a text of ``size`` characters is far over what a context of ``context_length`` tokens could hold
    (``HUGE_CHARS_PER_TOKEN`` characters a token, and at least ``HUGE_TEXT_CHARS``)."""
    return size > max(HUGE_TEXT_CHARS, HUGE_CHARS_PER_TOKEN * context_length)


async def run(huge: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the huge-text thread, or on the other."""
    return await asyncio.get_running_loop().run_in_executor(pool(huge), fn, *args)
