"""Outputs a role produces before the forward pass (a decode worker's first token, the moment its room reaches
Success) are handed out at once, not after the step's batch: in PD the first token would otherwise wait for the
second, and every time-to-first-token would include one decode step."""
from __future__ import annotations

from pathlib import Path

from engine.engine_core import EngineCore
from engine.role import EngineRole
from engine.sampling_params import SamplingParams
from engine.step_output import StepOutput
from tests.engine.conftest import make_core


class FirstTokenRole(EngineRole):
    """Emits one output for ``req`` from before_step, as DecodeRole._activate does for a room that succeeded."""

    def __init__(self) -> None:
        self.pending: list = []

    def before_step(self, core: EngineCore) -> list[StepOutput]:
        out, self.pending = [StepOutput(r, [r.prompt_ids[-1]]) for r in self.pending], []
        return out


def test_role_outputs_are_emitted_before_the_forward_pass(tiny_model_dir: Path) -> None:
    role = FirstTokenRole()
    core = make_core(tiny_model_dir, role=role)
    events: list[str] = []
    forward = core.runner.forward

    def recorded_forward(batch):  # noqa: ANN001, ANN202
        events.append("forward")
        return forward(batch)
    core.runner.forward = recorded_forward
    running = core.make_request([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0))
    core.add_request(running)
    arriving = core.make_request([8, 9], SamplingParams(max_new_tokens=4, temperature=0))
    role.pending = [arriving]
    rest = core.step(emit=lambda outs: events.append("emit:" + ",".join(o.req.rid for o in outs)))
    assert events == [f"emit:{arriving.rid}", "forward"]
    assert [o.req.rid for o in rest] == [running.rid]  # the step's own outputs still come back
    role.pending = [arriving]
    assert [o.req.rid for o in core.step()] == [arriving.rid, running.rid]  # without emit: all at the end
