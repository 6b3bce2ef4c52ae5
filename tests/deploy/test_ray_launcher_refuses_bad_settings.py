"""Settings the Ray launcher cannot run with are refused with status 2 and a message naming the flag, before it
connects to any Ray cluster."""
from __future__ import annotations

import pytest

from deploy.ray.launch import main


@pytest.mark.parametrize("flags, message", [
    (["--prefill", "0"], "--prefill and --decode must each be at least 1"),
    (["--num-cpus-per-worker", "0"], "give --num-cpus-per-worker or the role's GPUs"),
    (["--max-restarts", "-2"], "--max-restarts must be -1"),
    (["--port", "99999"], "--port 99999 is not a port number"),
])
def test_bad_settings_name_the_flag(capsys, flags: list[str], message: str) -> None:
    assert main(["--address", "127.0.0.1:1", *flags]) == 2
    assert message in capsys.readouterr().err
