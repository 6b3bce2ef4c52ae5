"""A local Mooncake Store master for HiCache's shared tier (tests, benchmarks, one-host clusters)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from deploy.process import free_ports


class MooncakeMaster:
    """A ``mooncake_master`` (the Mooncake Store's metadata service, shipped in the mooncake wheel) on loopback
    ports, for tests and benchmarks; ``freeze``/``thaw`` stop and continue it, ``kill`` and ``start`` take it down
    and up again on the same port (a restarted master starts empty: clients mount their segments again)."""

    def __init__(self, *extra: str) -> None:
        exe = Path(sys.executable).with_name("mooncake_master")
        self.exe = str(exe) if exe.exists() else "mooncake_master"
        self.port, self.admin_port = free_ports(2)
        self.address = f"127.0.0.1:{self.port}"
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"splitserve-test-mooncake-master-{self.port}.log"

    def start(self) -> MooncakeMaster:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([self.exe, "--rpc_address", "127.0.0.1", "--rpc_port", str(self.port),
                                      "--metrics_host", "127.0.0.1", "--metrics_port", str(self.admin_port),
                                      *self.extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-3000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master not listening on {self.port} after 30 s")
            time.sleep(0.05)

    def extra_config(self, **opts: object) -> str:
        """``--hicache-storage-backend-extra-config`` for a client of this master (small segments for tests)."""
        return json.dumps({"master_server_address": self.address, "local_hostname": "127.0.0.1",
                           "global_segment_size": "64mb", **opts})

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
