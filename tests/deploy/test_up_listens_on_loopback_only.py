"""``splitserve up`` (host 127.0.0.1) listens on loopback only: every listening socket of its process tree (router,
workers' HTTP, the prefill bootstrap gRPC, and no Mooncake engine, since same-host workers use shared memory) is
bound to 127.0.0.1 or ::1, never to all interfaces; and the cluster serves."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import httpx

from tests.deploy.conftest import children_of


def _listening_inodes() -> dict[int, str]:
    """inode -> local address of every TCP socket in LISTEN state (from /proc/net/tcp and tcp6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] != "0A":  # LISTEN
                continue
            hex_ip = parts[1].split(":")[0]
            raw = bytes.fromhex(hex_ip)
            # the kernel prints each 32-bit word in host (little-endian) order
            ip = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[int(parts[9])] = str(ipaddress.ip_address(ip))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def test_up_listens_on_loopback_only(up_factory) -> None:  # noqa: ANN001
    up = up_factory("--model-path", "tiny")
    router = up.wait_ready()
    assert httpx.post(router + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
    listening = _listening_inodes()
    bound = [listening[i] for pid in children_of(up.proc.pid) | {up.proc.pid} for i in _socket_inodes(pid)
             if i in listening]
    assert len(bound) >= 4, bound  # router, two workers' HTTP, the bootstrap server
    addresses = {ipaddress.ip_address(a) for a in bound}
    loopback = {a for a in addresses
                if a.is_loopback or (a.version == 6 and a.ipv4_mapped and a.ipv4_mapped.is_loopback)}
    assert addresses == loopback, f"listening beyond loopback: {sorted(map(str, addresses - loopback))}"
