"""The engine's outputs reach their requests' streams even when the observer given at construction (the server's
metrics) raises on them: a bug in what watches the outputs never leaves a client waiting for its deadline."""
from __future__ import annotations

import asyncio
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from engine.step_output import StepOutput
from tests.engine.conftest import make_core


def test_requests_finish_when_the_observer_raises(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    seen: list[int] = []

    def observer(outputs: list[StepOutput]) -> None:
        seen.append(len(outputs))
        raise RuntimeError("a metrics bug")

    async def run() -> list[list[int]]:
        engine = AsyncEngine(core, on_outputs=observer)
        engine.start()
        try:
            reqs = [core.make_request([5, 6, 7, i], SamplingParams(max_new_tokens=4, ignore_eos=True,
                                                                   temperature=0.0)) for i in range(3)]

            async def one(req):  # noqa: ANN001, ANN202
                async for _ in engine.generate([req]):
                    pass
                return req.output_ids
            return await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs)), timeout=20)
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    assert [len(o) for o in outputs] == [4, 4, 4]
    assert seen  # the observer was called, and failed, every time
