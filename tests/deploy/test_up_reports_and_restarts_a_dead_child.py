"""A child of ``splitserve up`` that dies is reported at once with the tail of its log. With ``--restart`` it comes
back on the same port and the cluster serves again; without it, losing the only decode worker stops everything
with status 1. If ``splitserve up`` itself is killed outright, its children still go (the kernel signals them)."""
from __future__ import annotations

import os
import re
import signal

from tests.deploy.conftest import chat_succeeds_within, children_of, cmdline, wait_all_gone


def death_report(up, name: str, pid: int, start: int) -> None:
    """The report names the child, its PID and how it died, and quotes its log's last lines."""
    up.wait_for(rf"\[up\] {name} \(pid {pid}\) killed by SIGKILL after [\d.]+s; last \d+ lines of \S+{name}\.log:",
                30, start)
    up.wait_for(r"\[up\]     .*Uvicorn running on", 5, start)


def test_restart_brings_a_killed_decode_worker_back(up_factory) -> None:
    up = up_factory("--restart", "--model-path", "tiny")
    router = up.wait_ready()
    old = up.pid_of("decode-0")
    old_url = next(p["url"] for p in up.state()["processes"] if p["name"] == "decode-0")
    mark = len(up.lines)
    os.kill(old, signal.SIGKILL)
    death_report(up, "decode-0", old, mark)
    up.wait_for(r"\[up\] restarting decode-0 \(restart 1 of 5\)", 30, mark)
    up.wait_for(r"\[up\] decode-0 is healthy again", 120, mark)
    new = up.pid_of("decode-0")
    assert new != old
    assert next(p["url"] for p in up.state()["processes"] if p["name"] == "decode-0") == old_url
    assert "restart 1" in (up.run_dir / "decode-0.log").read_text()
    reply = chat_succeeds_within(router, 90)
    assert reply.json()["choices"][0]["message"]["content"]

    # splitserve up killed with no chance to clean up: its children are signalled by the kernel and exit.
    tree = children_of(up.proc.pid)
    assert new in tree
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(10)
    left = wait_all_gone(tree, 60)
    assert not left, "children outlived a killed splitserve up: " + "; ".join(f"{p}: {cmdline(p)}" for p in left)


def test_without_restart_losing_the_only_decode_worker_stops_everything(up_factory) -> None:
    up = up_factory("--model-path", "tiny")
    up.wait_ready()
    tree = children_of(up.proc.pid)
    victim = up.pid_of("decode-0")
    mark = len(up.lines)
    os.kill(victim, signal.SIGKILL)
    death_report(up, "decode-0", victim, mark)
    up.wait_for(r"decode-0 is not restarted \(run with --restart for that\), and no decode worker is left; stopping",
                10, mark)
    assert up.proc.wait(90) == 1
    left = wait_all_gone(tree, 10)
    assert not left, "left running: " + "; ".join(f"{p}: {cmdline(p)}" for p in left)
    assert not re.search(r"restarting decode-0", up.text())
