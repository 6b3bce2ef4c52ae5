"""Runs an EngineCore on its own thread and bridges it to asyncio, so the event loop never blocks on a forward
pass. Commands (add, abort, calls) go in through a thread-safe queue; each step's outputs come back in one
``call_soon_threadsafe`` and are fanned out to per-request asyncio queues.

A watchdog: the engine thread notes when its current work (commands, then a step) began, and one asyncio task
looks at that clock a few times per ``stall_timeout_secs`` (never once per token). Work running longer (a hung
forward pass, say) makes ``stalled`` true: /health answers 503, so a router takes the worker out of rotation,
and every request waiting on an output fails with EngineStalled instead of waiting for its whole deadline.
Requests merely queued are not affected: the clock runs only while the thread works."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.engine_core import EngineCore
from engine.request import Abort, Request, Status
from engine.sampling_params import InvalidRequestError
from engine.step_output import StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` (loading the model, allocating the pool) on a thread that then ends: its result, or its
    exception raised here. Why: each thread that runs an OpenMP region keeps a pool of OpenMP threads for as
    long as it lives, and once the pools' threads outnumber the cores libgomp shortens their spin-wait, so
    (the likely mechanism) every parallel region of a step waits for sleeping threads to wake. Loading on the
    main thread left its pool beside the engine thread's: on 2 cores (AMD EPYC) the few-rows GEMM at one row
    took 60-89 us on a second thread against 29 us on the first, and a SmolLM2 float32 batch-1 step 32-38 ms
    against 20-24 ms. A thread's pool goes with it, so only the engine thread's is left."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["result"] = build()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            box["error"] = e

    thread = threading.Thread(target=body, name="engine-build", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped (HTTP 503)."""


class EngineStalled(RuntimeError):
    """The engine's current step has run past ``stall_timeout_secs`` (HTTP 503)."""


_STALLED = object()  # put on every waiting stream by the watchdog


class AsyncEngine:
    def __init__(self, core: EngineCore, on_outputs: Callable[[list[StepOutput]], None] | None = None) -> None:
        self.core = core
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._on_outputs = on_outputs
        self.max_queued = core.cfg.scheduler.max_queued_requests
        self.stall_timeout = core.cfg.scheduler.stall_timeout_secs
        self._step_started: float | None = None  # set by the engine thread while it works
        self._watchdog: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self._watchdog = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.stall_timeout / 4)
            if self.stalled:
                for q in {id(q): q for q in self._streams.values()}.values():
                    q.put_nowait(_STALLED)

    def abort_all(self, reason: Abort = Abort(503, "the server is shutting down")) -> None:
        for rid in list(self._streams):
            self._inbox.put(("abort", (rid, reason)))

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the thread."""
        self.abort_all()
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def stalled(self) -> bool:
        return self.stalled_for > self.stall_timeout

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            wait = None if not self._stopping else 0.0
            wait = core.idle_wait() if wait is None else wait
            if wait is None and core.idle_chore():
                wait = 0.0  # idle, but with background work: poll for commands between its pieces
            try:
                cmds = [self._inbox.get(block=wait != 0.0, timeout=wait)] if wait != 0.0 else []
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            outputs: list[StepOutput] = []
            self._step_started = time.monotonic()  # the watchdog's clock: commands and the step
            for kind, arg in cmds:
                self._apply(kind, arg, outputs)
            if self._stopping and not core.has_work:
                self._step_started = None
                self._deliver(outputs)
                core.close()
                return
            self._deliver(outputs)  # what the commands produced (adds refused, aborts) goes out before the step
            outputs = []
            try:
                outputs.extend(core.step(emit=self._deliver))
            except Exception as e:  # a failed step must not take the server down: fail what was running
                log.exception("engine step failed; aborting the running requests")
                for req in list(core.scheduler.running):
                    out = core.abort(req.rid, Abort(500, f"the engine step failed ({type(e).__name__}); the "
                                                          "requests it was running were aborted", "internal_error"))
                    if out:
                        outputs.append(out)
            finally:
                self._step_started = None
            self._deliver(outputs)

    def _apply(self, kind: str, arg: Any, outputs: list[StepOutput]) -> None:
        core = self.core
        if kind == "add":
            try:
                core.add_request(arg)
            except Exception as e:  # noqa: BLE001 - reported to the request's stream
                status = 400 if isinstance(e, InvalidRequestError) else 500
                arg.status, arg.finish_reason, arg.finish_detail = Status.FINISHED, "abort", Abort(status, str(e))
                outputs.append(StepOutput(arg, finished=True))
        elif kind == "abort":
            rid, reason = arg
            out = core.abort(rid, reason)
            if out:
                outputs.append(out)
        elif kind == "call":
            fn, fut = arg
            try:
                result = fn(core)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                self._resolve(fut, exc=e)
            else:
                self._resolve(fut, result=result)

    def _resolve(self, fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
        assert self._loop is not None

        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        self._loop.call_soon_threadsafe(done)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        if self._on_outputs is not None:
            try:
                self._on_outputs(outputs)
            except Exception:  # an observer's failure (metrics) must not keep the outputs from their streams
                log.exception("the outputs' observer failed; the outputs are delivered regardless")
        for out in outputs:
            q = self._streams.get(out.req.rid)
            if q is not None:
                q.put_nowait(out)

    # -- the asyncio side ----------------------------------------------------------------------------------------
    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread between steps and return its result."""
        assert self._loop is not None
        fut: asyncio.Future[T] = self._loop.create_future()
        self._inbox.put(("call", (fn, fut)))
        return await fut

    def submit(self, reqs: list[Request]) -> asyncio.Queue[Any]:
        """Queue ``reqs`` (e.g. the n choices of one prompt); their outputs arrive on one shared queue."""
        if not self.alive or self._stopping:
            raise EngineDead("the engine is not running")
        if len(self._streams) + len(reqs) > self.max_queued + self.core.cfg.scheduler.max_running_requests:
            raise EngineOverloaded(f"{len(self._streams)} requests in flight; try again later")
        q: asyncio.Queue[Any] = asyncio.Queue()
        for req in reqs:
            self._streams[req.rid] = q
            self._inbox.put(("add", req))
        return q

    def abort(self, rid: str, reason: Abort = Abort(499, "aborted by the client")) -> None:
        if rid in self._streams:
            self._inbox.put(("abort", (rid, reason)))

    async def generate(self, reqs: list[Request]) -> AsyncIterator[StepOutput]:
        """Yield the requests' outputs until all finish; leaving early (cancel, disconnect) aborts the rest."""
        q = self.submit(reqs)
        pending = {r.rid for r in reqs}
        try:
            while pending:
                out = await q.get()
                if out is _STALLED:
                    raise EngineStalled(f"the engine's current step has run for {self.stalled_for:.0f}s, past "
                                        f"--stall-timeout-secs ({self.stall_timeout:g}s); the request is abandoned "
                                        "and the worker reports itself unhealthy")
                if out.finished:
                    pending.discard(out.req.rid)
                yield out
        finally:
            for req in reqs:
                self._streams.pop(req.rid, None)
            for rid in pending:
                self._inbox.put(("abort", (rid, Abort(499, "the client went away"))))

    # -- load --------------------------------------------------------------------------------------------------
    def load(self) -> dict[str, int]:
        s = self.core.scheduler
        return {"running": len(s.running), "queued": len(s.waiting),
                "kv_pages_used": self.core.allocator.used, "kv_pages_total": self.core.allocator.capacity}
