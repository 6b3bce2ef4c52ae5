"""Where long text work runs: tokenizing, rendering chat templates and detokenizing, off the event loop.

Two single-thread pools by size: texts up to ``HUGE_TEXT_CHARS`` (a long prompt that fits the context, a few
milliseconds to tokenize) and texts over it (megabytes that pass the cheap length bound, hundreds of
milliseconds each). So text work never takes more than two cores, however many prompts arrive at once, and an
ordinary long prompt never queues behind megabyte ones. The work is CPU-bound and HF tokenizers release the GIL
while they encode: with asyncio's default pool (one thread per core plus four), ten 1 MiB prompts tokenized at
once took both cores of a 2-core host from the engine thread, and a running stream's worst gap was 300 ms (11x
its median step); with one thread for them it was 100 ms (measured interleaved, benchmarks/bench_event_loop.py;
numbers in docs/benchmarks.md). Lowering the threads' priority instead (``nice``) made it worse: a descheduled
text thread holding the GIL then held up the engine."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
HUGE_TEXT_CHARS = 1 << 16

_pools: dict[bool, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(chars: int) -> ThreadPoolExecutor:
    """The process's pool for a text of ``chars`` characters, made on first use."""
    huge = chars > HUGE_TEXT_CHARS
    with _lock:
        if huge not in _pools:
            _pools[huge] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-huge" if huge else "text")
        return _pools[huge]


async def run(chars: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), working on a text of ``chars`` characters, on that size's text thread."""
    return await asyncio.get_running_loop().run_in_executor(pool(chars), fn, *args)
