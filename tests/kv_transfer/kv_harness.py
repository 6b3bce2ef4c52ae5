"""Drive peer_proc.py children: every read is bounded in time, and every child is killed at teardown."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEER_SCRIPT = Path(__file__).with_name("peer_proc.py")
REPO = Path(__file__).resolve().parents[2]

# Short deadlines so failure tests finish in seconds.
FAST = {
    "hostname": "127.0.0.1", "heartbeat_interval": 0.25, "heartbeat_timeout": 1.5, "rpc_timeout": 2.0,
    "bootstrap_timeout": 3.0, "waiting_timeout": 3.0, "transfer_timeout": 10.0, "room_linger": 30.0,
}


class PeerError(Exception):
    """A typed kv_transfer error raised inside a peer process."""

    def __init__(self, reply: dict[str, Any], log_tail: str = "") -> None:
        super().__init__(f"{reply['exc']}: {reply['message']}\n--- peer log tail ---\n{log_tail}")
        self.type = reply["exc"]
        self.reply = reply


class Peer:
    def __init__(self, role: str, backend: str, *, seed: int, config: dict[str, Any] | None = None,
                 name: str = "", **shape: Any) -> None:
        cfg = {**FAST, "backend": backend, **(config or {})}
        argv = [sys.executable, str(PEER_SCRIPT), "--role", role, "--seed", str(seed), "--config", json.dumps(cfg)]
        if name:
            argv += ["--name", name]
        for key, value in shape.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        self.role = role
        # stderr goes to a file: an undrained pipe would block a chatty child once it fills up.
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env, cwd=str(REPO))
        ready = self._read(timeout=60.0)
        self.port: int | None = ready.get("port")

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role} peer gave no reply within {timeout}s: {self.stderr_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.role} peer exited (rc={self.proc.poll()}): {self.stderr_tail()}")
            return json.loads(line)

    def stderr_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def call(self, cmd: str, read_timeout: float = 30.0, **kwargs: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(read_timeout)
        if "exc" in reply:
            raise PeerError(reply, self.stderr_tail(1500))
        return reply

    def wait(self, room: int, states: list[str], timeout: float) -> dict[str, Any]:
        return self.call("wait", read_timeout=timeout + 10.0, room=room, states=states, timeout=timeout)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()
        self._log.close()

    def close(self) -> None:
        """Ask the peer to exit; kill it if it does not within a few seconds."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def open_room(prefill: Peer, decode: Peer, room: int, dst: list[int], aux_slot: int = 0) -> None:
    """Decode reserves `dst`, prefill creates the sender; returns once prefill is WaitingForInput."""
    decode.call("recv", room=room, port=prefill.port, pages=dst, aux_slot=aux_slot)
    prefill.call("sender", room=room)
    got = prefill.wait(room, ["WAITING_FOR_INPUT"], 5)
    assert got["state"] == "WAITING_FOR_INPUT", got


def run_room(prefill: Peer, decode: Peer, room: int, src: list[int], dst: list[int], aux_slot: int = 0) -> None:
    """A whole healthy room; asserts Success on both sides and byte-exact pages."""
    open_room(prefill, decode, room, dst, aux_slot)
    prefill.call("send", room=room, pages=src, last=True, first_token=room % 1000)
    got = decode.wait(room, ["SUCCESS", "FAILED"], 10)
    assert got["state"] == "SUCCESS", got
    assert prefill.wait(room, ["SUCCESS", "FAILED"], 5)["state"] == "SUCCESS"
    assert decode.call("checksums", pages=dst)["sums"] == prefill.call("checksums", pages=src)["sums"]
