"""Helpers for the deploy tests: ``splitserve up`` as a real child process whose output is read line by line, and
the process tree under a PID (Linux /proc), to prove that nothing outlives a launcher."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import REPO

# Small pools keep several workers within a shared CI machine's memory.
SMALL_WORKERS = "--max-total-tokens 8192 --page-size 4"


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def wait_all_gone(pids: set[int], timeout: float) -> set[int]:
    """The PIDs still alive after waiting up to ``timeout`` s for them to go."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {p for p in pids if alive(p)}
        if not left:
            return left
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


def environ_of(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


CHAT = {"model": "tiny-model-v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def chat_succeeds_within(router: str, seconds: float) -> httpx.Response:
    """Bounded retries: the first requests after a restart may fail while the peers reconnect."""
    deadline = time.monotonic() + seconds
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        try:
            last = httpx.post(router + "/v1/chat/completions", json=CHAT, timeout=60)
            if last.status_code == 200:
                return last
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"no successful chat completion within {seconds}s; last: "
                         f"{last.status_code if last else None} {last.text if last else ''}")


class LineReader:
    """A child process whose stdout (stderr merged) is collected line by line on a thread."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        """The first match of ``pattern`` in a line at index >= ``start``; fails with the output on timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if m := rx.search(line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    pytest.fail(f"no line matching {pattern!r} within {timeout}s (exit {self.proc.poll()}); "
                                f"output:\n" + "\n".join(self.lines[-80:]))
                self._cond.wait(min(left, 0.5))

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        """Last resort for a failed test: kill the launcher's group and every descendant, and say so."""
        if self.proc.poll() is None:
            left = children_of(self.proc.pid)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


class Up(LineReader):
    """``python -m splitserve up`` (the ``splitserve up`` console script's code path) on free ports."""

    def __init__(self, run_dir: Path, *flags: str) -> None:
        self.run_dir = run_dir
        super().__init__([sys.executable, "-m", "splitserve", "up", "--port", "0", "--run-dir", str(run_dir),
                          f"--worker-args={SMALL_WORKERS}", *flags], run_dir.parent / f"{run_dir.name}.out")

    def wait_ready(self, timeout: float = 300.0) -> str:
        return self.wait_for(r"SplitServe is ready: router at (http://\S+)", timeout).group(1)

    def state(self) -> dict:
        return json.loads((self.run_dir / "cluster.json").read_text())

    def pid_of(self, name: str) -> int:
        return next(p["pid"] for p in self.state()["processes"] if p["name"] == name)


@pytest.fixture
def up_factory(tmp_path: Path):
    started: list[Up] = []

    def start(*flags: str, name: str = "run") -> Up:
        up = Up(tmp_path / name, *flags)
        started.append(up)
        return up

    yield start
    for up in started:
        up.close()
