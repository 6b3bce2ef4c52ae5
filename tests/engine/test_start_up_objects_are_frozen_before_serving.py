"""What start-up leaves alive (model modules, tokenizer, imported modules) is moved out of the garbage collector's
full collections before a server serves, so no full collection walks it in the middle of a decode step
(``launch.freeze_start_up_objects``)."""
from __future__ import annotations

import gc
import re
from pathlib import Path

from engine.server.launch import freeze_start_up_objects
from tests.helpers import ServerProcess


class _Node:
    """A container object the collector tracks."""


def test_objects_alive_at_the_freeze_are_frozen_and_later_ones_are_not() -> None:
    before = _Node()
    try:
        frozen = freeze_start_up_objects()
        after = _Node()
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before) not in tracked and id(after) in tracked
        assert frozen == gc.get_freeze_count() > 1000  # the test process's modules, at least
    finally:
        gc.unfreeze()


def test_a_server_freezes_its_start_up_objects_before_it_serves(tiny_model_dir: Path) -> None:
    srv = ServerProcess("engine", ["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096"]).wait_ready()
    try:
        found = re.search(r"froze (\d+) start-up objects", srv.log())
        assert found and int(found.group(1)) > 50_000, srv.log()  # torch, the model, the tokenizer, FastAPI
    finally:
        srv.stop()
