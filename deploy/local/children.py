"""One supervised process of ``splitserve up``: started with its output teed to the terminal (a prefix per
process) and to its log file, restartable with the same command line, stopped with its whole process group."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from deploy.process import LogPump, describe_exit, signal_group, spawn, sweep_group

_COLORS = ("36", "33", "35", "32", "34", "31")


class Terminal:
    """Serializes lines from many children onto one stream, each with its process's name in front."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.color = self.stream.isatty() and os.environ.get("NO_COLOR") is None
        self._lock = threading.Lock()
        self.width = 9

    def prefixed(self, name: str, index: int) -> Callable[[str], None]:
        tag = f"{name:<{self.width}}|"
        if self.color:
            tag = f"\x1b[{_COLORS[index % len(_COLORS)]}m{tag}\x1b[0m"
        return lambda line: self.write(f"{tag} {line}")

    def write(self, text: str) -> None:
        with self._lock:
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # the terminal went away; the log files still get everything
                pass

    def say(self, text: str) -> None:
        """A line from ``splitserve up`` itself."""
        self.write("\n".join(f"[up] {line}" for line in text.splitlines()))



class Child:
    """A named process (router, prefill-N, decode-N) with a fixed command line and log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, terminal: Terminal, index: int,
                 env: dict[str, str], url: str, health_path: str) -> None:
        self.name, self.argv, self.log_path, self.env = name, list(argv), log_path, env
        self.url, self.health_path = url, health_path
        self._terminal, self._index = terminal, index
        self.proc: subprocess.Popen | None = None
        self.pump: LogPump | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.restart_due: float | None = None  # monotonic time of a scheduled restart
        self._log: IO[str] | None = None

    def start(self) -> None:
        self._close_log()
        self._log = open(self.log_path, "a", encoding="utf-8")
        if self.restarts:
            self._log.write(f"----- splitserve up: restart {self.restarts} -----\n")
        self._log.write(f"$ {' '.join(self.argv)}\n")
        self._log.flush()
        log = self._log

        def to_file(line: str) -> None:
            try:
                log.write(line + "\n")
                log.flush()
            except ValueError:  # closed: the process was stopped while its last lines were in flight
                pass

        self.proc = spawn(self.argv, env=self.env)
        assert self.proc.stdout is not None
        self.pump = LogPump(self.proc.stdout, [to_file, self._terminal.prefixed(self.name, self._index)])
        self.started_at = time.monotonic()
        self.restart_due = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return None if self.proc is None else self.proc.poll()

    def death_report(self, tail: int) -> str:
        assert self.proc is not None and self.pump is not None
        self.pump.join(2.0)  # let the last lines arrive
        lines = self.pump.tail(tail)
        head = (f"{self.name} (pid {self.proc.pid}) {describe_exit(self.proc.returncode)} after "
                f"{time.monotonic() - self.started_at:.1f}s; ")
        if not lines:
            return head + f"it wrote nothing (log: {self.log_path})"
        return head + f"last {len(lines)} lines of {self.log_path}:\n" + "\n".join(f"    {ln}" for ln in lines)

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            signal_group(self.proc, sig)

    def finish(self) -> None:
        """After the process exited: clear its group of leftovers, drain its output, close its log."""
        if self.proc is not None:
            sweep_group(self.proc)
        if self.pump is not None:
            self.pump.join(2.0)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
