"""The engine watchdog: while the engine thread is stuck in one piece of work past --stall-timeout-secs (a hung
forward pass; here a call that sleeps on the engine thread), the engine reports itself stalled (/health answers
503) and a request waiting for its next output fails with EngineStalled instead of waiting for its whole
deadline. When the thread comes back the abandoned request is aborted and its pages freed; the engine serves
again. A request that is merely slow (no stuck step) is never failed."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine, EngineStalled
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

STALL_S = 0.5


def test_a_stuck_engine_fails_its_waiting_requests(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, stall_timeout=STALL_S)

    async def run() -> None:
        engine = AsyncEngine(core)
        engine.start()
        try:
            req = core.make_request([5, 6, 7, 8], SamplingParams(max_new_tokens=3000, ignore_eos=True,
                                                                 temperature=0.0), rid="long")
            outs = engine.generate([req])
            await outs.__anext__()
            assert not engine.stalled
            hang = asyncio.ensure_future(engine.call(lambda _core: time.sleep(6 * STALL_S)))  # the thread hangs
            with pytest.raises(EngineStalled, match="stall-timeout-secs"):
                async for _ in outs:
                    pass
            assert engine.stalled and engine.stalled_for > STALL_S
            await hang
            await outs.aclose()
            for _ in range(100):  # the abort queued by the failed stream is applied once the thread is back
                if await engine.call(lambda c: (not c.scheduler.running and not c.requests)):
                    break
                await asyncio.sleep(0.02)
            assert not engine.stalled
            assert await engine.call(lambda c: not c.scheduler.running and not c.requests)
            # a fresh request is served as usual, with steps far shorter than the deadline
            fresh = core.make_request([9, 10], SamplingParams(max_new_tokens=4, temperature=0.0), rid="fresh")
            got = [o async for o in engine.generate([fresh])]
            assert got[-1].finished and len(fresh.output_ids) == 4
        finally:
            await engine.shutdown()
    asyncio.run(run())
    core.scheduler.check_integrity()
