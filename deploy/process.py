"""Child processes that cannot outlive their launcher: each starts in its own session (so signals reach its whole
process group, and a terminal's Ctrl-C reaches only the launcher), and on Linux asks the kernel to send it
SIGTERM when the launcher dies, however it dies. Also: free ports, a process's RSS, and a log pump that tees a
child's output."""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec: nothing but one system call
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def spawn(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start ``argv`` with stdout and stderr on one pipe, in a new session, tied to this thread's life."""
    return subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
                            preexec_fn=_die_with_parent)


def group_members(pgid: int) -> list[int]:
    """PIDs still in process group ``pgid`` (Linux /proc; empty elsewhere)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def stop_group(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM the child's process group, wait up to ``timeout`` s, then SIGKILL what is left of the group
    (grandchildren included). Returns the child's exit status."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait(10)
    sweep_group(proc)
    return proc.returncode


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group while the child is alive (so the group is certainly ours)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def sweep_group(proc: subprocess.Popen) -> None:
    """After the child (its group's leader) has exited: SIGKILL anything it left behind in its group."""
    for pid in group_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


_handed_out: set[tuple[str, int]] = set()
_handed_out_lock = threading.Lock()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free a moment ago, none handed out before by this process.

    The kernel may give the same ephemeral port to two ``bind(0)`` calls made one after the other once the first
    socket is closed; a launcher that asks twice before either server binds (an HTTP port, then a bootstrap port)
    would then start two servers on one port. Remembering every port handed out rules that out."""
    socks: list[socket.socket] = []
    try:
        with _handed_out_lock:
            for _ in range(64 * count):
                if len(socks) == count:
                    break
                s = socket.socket()
                s.bind((host, 0))
                if (host, s.getsockname()[1]) in _handed_out:
                    s.close()
                    continue
                socks.append(s)
            if len(socks) < count:
                raise OSError(f"no {count} fresh free ports on {host}")
            ports = [s.getsockname()[1] for s in socks]
            _handed_out.update((host, p) for p in ports)
            return ports
    finally:
        for s in socks:
            s.close()


def _proc_kib(pid: int, file: str, key: str) -> int:
    """One ``key: N kB`` line of /proc/<pid>/<file>, in bytes; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes(pid: int) -> int:
    """A process's resident set size (Linux /proc), 0 once it is gone."""
    return _proc_kib(pid, "status", "VmRSS:")


def pss_bytes(pid: int) -> int:
    """A process's proportional set size: its resident pages, each shared page divided among its sharers, so a
    tree's sum counts the libraries and shared memory its processes share once (0 once it is gone)."""
    return _proc_kib(pid, "smaps_rollup", "Pss:")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents before their children (Linux /proc; none that exited)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        tree.append(p := todo.pop())
        todo += children.get(p, [])
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) used so far by ``pid`` and its descendants that are still running."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class LogPump:
    """Reads a child's output line by line on a daemon thread and hands each line to ``sinks`` (callables);
    keeps the last ``keep`` lines for a death report."""

    def __init__(self, stream: IO[bytes], sinks: Sequence[Callable[[str], None]], keep: int = 200) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._stream = stream
        self._sinks = list(sinks)
        self._thread = threading.Thread(target=self._run, daemon=True, name="log-pump")
        self._thread.start()

    def _run(self) -> None:
        for raw in iter(self._stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            for sink in self._sinks:
                sink(line)
        self._stream.close()

    def join(self, timeout: float) -> None:
        """Wait (bounded) until the child's output is drained, so a death report has its last lines."""
        self._thread.join(timeout)

    def tail(self, n: int) -> list[str]:
        return list(self.lines)[-n:]


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:.1f}s"
