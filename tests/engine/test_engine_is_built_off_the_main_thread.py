"""The servers build the engine (model load, pool) on a thread that then ends, so the OpenMP threads the load
started end with it and the engine thread's parallel regions do not share the cores with an idle second pool
(see ``build_off_main_thread``)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.async_engine import build_off_main_thread
from tests.helpers import wait_until


def task_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_the_build_runs_on_another_thread_and_its_result_comes_back() -> None:
    seen: dict[str, threading.Thread] = {}

    def build() -> str:
        seen["thread"] = threading.current_thread()
        return "engine"

    assert build_off_main_thread(build) == "engine"
    assert seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()


def test_an_error_in_the_build_is_raised_on_the_calling_thread() -> None:
    error = ValueError("bad checkpoint")

    def build() -> None:
        raise error

    with pytest.raises(ValueError) as raised:
        build_off_main_thread(build)
    assert raised.value is error


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_the_openmp_threads_a_build_starts_end_with_it() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: OpenMP starts no pool")
    x = torch.randn(256, 256)
    x @ x  # the calling thread's own pool exists before, as it would after other work
    before = task_ids()
    during: set[str] = set()

    def build() -> None:
        y = torch.randn(1024, 1024)
        for _ in range(3):
            y @ y
        during.update(task_ids())

    build_off_main_thread(build)
    started = during - before
    assert started, "the build's parallel GEMM started no thread: nothing here is measured"
    wait_until(lambda: not (started & task_ids()), timeout=10.0, what="the build's OpenMP threads to exit")
