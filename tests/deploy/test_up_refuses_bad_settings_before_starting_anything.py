"""Settings ``splitserve up`` cannot run with are refused at once with status 2 and a message naming the flag to
change, before any process starts."""
from __future__ import annotations

import socket

import pytest

from deploy.local.up import main


def up(tmp_path, capsys, *flags: str) -> tuple[int, str]:
    code = main(["--run-dir", str(tmp_path / "run"), *flags])
    return code, capsys.readouterr().err


def test_a_taken_router_port_is_refused(tmp_path, capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = up(tmp_path, capsys, "--port", str(port))
    assert code == 2
    assert f"port {port} on 127.0.0.1 is taken" in err and "--port 0" in err
    assert not list((tmp_path / "run").glob("*.log")), "a process was started"


@pytest.mark.parametrize("flags, message", [
    (["--decode", "0"], "--prefill and --decode must each be at least 1"),
    (["--port", "70000"], "--port 70000 is not a port number"),
    (["--model-path", "/nonexistent/model"], "--model-path /nonexistent/model: no such file or folder"),
])
def test_bad_values_name_the_flag(tmp_path, capsys, flags: list[str], message: str) -> None:
    code, err = up(tmp_path, capsys, "--port", "0", *flags)
    assert code == 2 and message in err, err
