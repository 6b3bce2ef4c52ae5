"""Which prefill bootstrap addresses a decode worker will dial. A request names its prefill worker
(``bootstrap_host``/``bootstrap_port``, added by the router); without a check, anyone who can send a request could
make the decode worker connect to any address (a cloud metadata service, say) and register its KV layout, its
transport session and its cluster token there, and a fake "prefill" could then write into the KV pool.

Entries (``--prefill-allow``): ``*`` (anything), ``loopback`` (127.0.0.0/8, ::1, localhost), ``private``
(10/8, 172.16/12, 192.168/16, fc00::/7: where pods and cluster nodes live; link-local 169.254/16, home of metadata
services, is not in it), a network such as ``10.2.0.0/16``, an address or host name, each optionally ``:PORT``.
A host name matches only an entry naming it: nothing is resolved here (DNS on the event loop could stall it)."""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence

from engine.server.errors import APIError

log = logging.getLogger("decode_worker")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
KEYWORDS: dict[str, tuple[str, ...]] = {
    "loopback": ("127.0.0.0/8", "::1/128", "localhost"),
    "private": ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"),
}


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, int(port)
    return entry, None


class PrefillAllowList:
    def __init__(self, entries: Sequence[str]) -> None:
        self.any = False
        self.networks: list[tuple[Network, int | None]] = []
        self.names: list[tuple[str, int | None]] = []
        for raw in entries:
            for entry in KEYWORDS.get(raw, (raw,)):
                if entry == "*":
                    self.any = True
                    continue
                host, port = _split_port(entry)
                try:
                    self.networks.append((ipaddress.ip_network(host, strict=False), port))
                except ValueError:
                    if not host or "/" in host:
                        raise ValueError(f"--prefill-allow entry {raw!r} is neither a network, an address nor "
                                         "a host name") from None
                    self.names.append((host.lower(), port))
        self.entries = tuple(entries)

    def allows(self, host: str, port: int) -> bool:
        if self.any:
            return True
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return any(name == host.lower() and p in (None, port) for name, p in self.names)
        return any(ip in net and p in (None, port) for net, p in self.networks)

    def check(self, host: str, port: int, request_id: str) -> None:
        """403 for a prefill address this worker may not dial."""
        if self.allows(host, port):
            return
        log.warning("refused a prefill address request_id=%s prefill=%s:%d allowed=%s", request_id, host, port,
                    ",".join(self.entries))
        raise APIError(403, f"this decode worker does not connect to prefill bootstrap address {host}:{port}; "
                            "allow it with --prefill-allow", "prefill_not_allowed", "bootstrap_host")
