"""The hooks a worker role runs on the engine thread around every step. The colocated server uses the base
class (no hooks); the prefill and decode workers subclass it to drive KV transfers."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, StepOutput
    from engine.request import Request
    from engine.scheduler import ScheduledBatch


class EngineRole:
    name = "colocated"
    poll_interval_s = 0.002  # how often the engine thread polls transfers while it has nothing to compute

    def add(self, core: EngineCore, req: Request) -> None:
        """Where a new request goes (the decode role queues it for a KV transfer instead)."""
        core.scheduler.add(req)

    def before_step(self, core: EngineCore) -> list[StepOutput]:
        return []

    def after_step(self, core: EngineCore, batch: ScheduledBatch | None) -> list[StepOutput]:
        return []

    def on_abort(self, core: EngineCore, req: Request) -> None:
        """The request was aborted (client gone, shutdown): tell the peer."""

    def close(self) -> None:
        """Release transfer resources at shutdown."""
