"""TransferConfig: every knob of kv_transfer in one frozen dataclass, and its argparse flags.

Each field's flag is `--transfer-<field name with dashes>` (configflags), except the cluster token's two, which
ARCHITECTURE.md names `--cluster-token` and `--cluster-token-file`. Defaults live only here. Durations are seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from configflags import add_dataclass_args, dataclass_from_args, flag_of
from kv_transfer.wire.errors import ConfigError

BACKENDS = ("auto", "mooncake", "shm", "fake")
# The largest staging offer either side makes or accepts (a prefill worker allocates two slot-sized buffers).
MAX_STAGING_SLOT_BYTES = 1 << 30
MAX_STAGING_SLOTS = 64


def _opt(default: Any, help_text: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **extra})


@dataclass(frozen=True)
class TransferConfig:
    backend: str = _opt("auto", "auto = shm when both ends share a host, else mooncake; fake = in-process",
                        choices=BACKENDS)
    hostname: str = _opt("", "address peers use to reach this worker's transfer engine "
                             "(empty: this host's name resolved to an IP)")
    protocol: str = _opt("tcp", "Mooncake protocol: tcp, or rdma on RDMA clusters")
    device_name: str = _opt("", "Mooncake RDMA device names, comma separated (empty: auto)")
    metadata_server: str = _opt("P2PHANDSHAKE", "Mooncake metadata: P2PHANDSHAKE, or an etcd/http URL")
    rpc_port_min: int = _opt(0, "lowest Mooncake handshake/data port (sets MC_MIN_RPC_PORT; 0 = Mooncake default)")
    rpc_port_max: int = _opt(0, "highest Mooncake handshake/data port (sets MC_MAX_RPC_PORT; 0 = Mooncake default)")
    bootstrap_timeout: float = _opt(10.0, "seconds a room may stay Bootstrapping (handshake, room info)")
    waiting_timeout: float = _opt(30.0, "seconds a room may stay WaitingForInput (prefill queueing)")
    transfer_timeout: float = _opt(15.0, "seconds a Transferring room may go without progress")
    heartbeat_interval: float = _opt(1.0, "seconds between heartbeats to each peer")
    heartbeat_timeout: float = _opt(5.0, "seconds of peer silence after which its rooms fail")
    rpc_timeout: float = _opt(3.0, "deadline of each bootstrap gRPC call, seconds")
    max_batch_entries: int = _opt(1024, "largest transport batch (Mooncake fails batches above ~1024)")
    aux_staging_slots: int = _opt(1024, "prefill-side aux records that can be in flight at once")
    staging_slot_bytes: int = _opt(8 << 20, "bytes of each slot that scattered pages are staged through on Mooncake "
                                             "(one write per slot, copied into place by the decode side; 0 = off)")
    staging_slots: int = _opt(4, "staging slots the decode side keeps per prefill peer")
    monitor_interval: float = _opt(0.05, "seconds between deadline checks")
    room_linger: float = _opt(60.0, "seconds a finished room stays queryable before it is forgotten")
    # ARCHITECTURE.md names these two flags without the --transfer- prefix.
    cluster_token: str = _opt("", "shared secret on every bootstrap gRPC call (prefill: required of peers when "
                                  "set; decode: presented); or $SPLITSERVE_CLUSTER_TOKEN, or --cluster-token-file",
                              flag="--cluster-token")
    cluster_token_file: str = _opt("", "read the cluster token from this file", flag="--cluster-token-file")

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"transfer backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        for name in ("bootstrap_timeout", "waiting_timeout", "transfer_timeout", "heartbeat_interval",
                     "heartbeat_timeout", "rpc_timeout", "monitor_interval", "room_linger"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--transfer-{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("--transfer-heartbeat-timeout must exceed --transfer-heartbeat-interval")
        if not 1 <= self.max_batch_entries <= 1024:
            raise ConfigError("--transfer-max-batch-entries must be in [1, 1024] (Mooncake's batch limit)")
        if self.aux_staging_slots < 1:
            raise ConfigError("--transfer-aux-staging-slots must be >= 1")
        if not 0 <= self.staging_slot_bytes <= MAX_STAGING_SLOT_BYTES or not 1 <= self.staging_slots <= MAX_STAGING_SLOTS:
            raise ConfigError(f"--transfer-staging-slot-bytes must be in [0, {MAX_STAGING_SLOT_BYTES}] (0 = off) and "
                              f"--transfer-staging-slots in [1, {MAX_STAGING_SLOTS}]")

    def deadline_for(self, state_name: str) -> float:
        return {
            "BOOTSTRAPPING": self.bootstrap_timeout,
            "WAITING_FOR_INPUT": self.waiting_timeout,
            "TRANSFERRING": self.transfer_timeout,
        }[state_name]

    def resolved_hostname(self) -> str:
        if self.hostname:
            return self.hostname
        import socket

        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def apply_mooncake_env(self) -> None:
        """Mooncake reads its port range and TCP options from the environment at initialize() (its log level
        is set when kv_transfer.transport.mooncake is imported, before the library loads)."""
        if self.rpc_port_min:
            os.environ["MC_MIN_RPC_PORT"] = str(self.rpc_port_min)
        if self.rpc_port_max:
            os.environ["MC_MAX_RPC_PORT"] = str(self.rpc_port_max)
        # Mooncake's TCP transport otherwise opens a new connection for every entry: scattered pages (one
        # entry per page and layer) then crawl (0.01 GB/s measured here against 0.7-1.2 with the pool).
        os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "1")


def flag_name(field_name: str) -> str:
    return flag_of(TransferConfig, field_name, "transfer")


def add_transfer_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per TransferConfig field to `parser` (dest: transfer_<field>)."""
    add_dataclass_args(parser, TransferConfig, "KV transfer", prefix="transfer")


def transfer_config_from_args(args: argparse.Namespace) -> TransferConfig:
    """Build the config from a namespace parsed with add_transfer_flags; the cluster token resolved (flag,
    environment or file)."""
    from kv_transfer.auth import resolve_token

    cfg = dataclass_from_args(TransferConfig, args, prefix="transfer")
    return dataclasses.replace(cfg, cluster_token=resolve_token(cfg.cluster_token, cfg.cluster_token_file),
                               cluster_token_file="")
