"""The hooks a worker role runs on the engine thread around every step. The colocated server uses the base
class (no hooks); the prefill and decode workers subclass it to drive KV transfers. A role acts on its requests
only through EngineCore's role methods (queue, queue_held, queue_external, reserve_external, activate, end,
holds, release_held), never on the scheduler."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.request import Request
    from engine.scheduler import ScheduledBatch
    from engine.step_output import StepOutput


class EngineRole:
    name = "colocated"
    poll_interval_s = 0.002  # how often the engine thread polls transfers while it has nothing to compute

    def add(self, core: EngineCore, req: Request) -> None:
        """Where a new request goes (a role whose KV travels queues it held or external instead)."""
        core.queue(req)

    def before_step(self, core: EngineCore) -> list[StepOutput]:
        return []

    def after_step(self, core: EngineCore, batch: ScheduledBatch | None) -> list[StepOutput]:
        return []

    def on_abort(self, core: EngineCore, req: Request) -> None:
        """The request was aborted (client gone, shutdown): tell the peer."""

    def close(self) -> None:
        """Release transfer resources at shutdown."""
