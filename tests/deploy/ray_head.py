"""A real single-node Ray head on 127.0.0.1 for the launcher test: ``ray start --head --block`` in its own session,
on free ports, with a small object store; stopped through that process and then by signalling whatever is left of
its session (``ray stop`` would stop every Ray cluster on the machine, so it is not used)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy.process import free_ports
from tests.helpers import REPO

# Ray binds its node to the address its own helper chooses; with this switch it keeps to loopback (127.0.0.1),
# so nothing here is sent to any other address of the machine.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


def session_members(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(entry))
    return out


class RayHead:
    def __init__(self, num_cpus: int = 4) -> None:
        port, client_port, agent_port = free_ports(3)
        self.address = f"127.0.0.1:{port}"
        self.temp_dir = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")  # short: Ray's socket paths have a limit
        self.env = {**os.environ, **LOOPBACK_ENV,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        ray = Path(sys.executable).with_name("ray")
        self.log = open(Path(self.temp_dir) / "ray-start.log", "w")
        self.proc = subprocess.Popen(
            [str(ray), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port),
             "--num-cpus", str(num_cpus), "--num-gpus", "0", "--object-store-memory", str(100 * 2**20),
             "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", self.temp_dir],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)

    def wait_ready(self, timeout: float = 120.0) -> RayHead:
        ray = Path(sys.executable).with_name("ray")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: {self.output()}")
            res = subprocess.run([str(ray), "health-check", "--address", self.address], env=self.env,
                                 capture_output=True, timeout=60)
            if res.returncode == 0:
                return self
            time.sleep(1)
        raise TimeoutError(f"the Ray head was not up within {timeout}s: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return (Path(self.temp_dir) / "ray-start.log").read_text()[-4000:]

    def stop(self) -> list[int]:
        """SIGINT to ``ray start --block`` (it then stops the processes it started); anything of the head's session
        still there after that gets SIGTERM, then SIGKILL. Returns the PIDs that survived all of it."""
        sid = self.proc.pid
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            left = session_members(sid)
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while session_members(sid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if sig == signal.SIGTERM and not session_members(sid):
                break
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        return session_members(sid)
