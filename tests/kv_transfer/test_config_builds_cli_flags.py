"""TransferConfig is the single source of the --transfer-* flags and rejects bad values with the flag's name."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from kv_transfer import ConfigError, TransferConfig, add_transfer_flags, transfer_config_from_args
from kv_transfer.config import flag_name


def test_flags_round_trip_and_defaults_live_in_the_dataclass() -> None:
    parser = argparse.ArgumentParser()
    add_transfer_flags(parser)
    assert transfer_config_from_args(parser.parse_args([])) == TransferConfig()
    args = parser.parse_args(["--transfer-backend", "shm", "--transfer-heartbeat-timeout", "2.5",
                              "--transfer-rpc-port-min", "20000", "--transfer-max-batch-entries", "512"])
    cfg = transfer_config_from_args(args)
    assert (cfg.backend, cfg.heartbeat_timeout, cfg.rpc_port_min, cfg.max_batch_entries) == ("shm", 2.5, 20000, 512)
    help_text = parser.format_help()
    for f in dataclasses.fields(TransferConfig):
        assert flag_name(f.name) in help_text
    assert "--cluster-token" in help_text and "--transfer-cluster-token" not in help_text  # ARCHITECTURE.md's name


def test_unknown_backend_is_rejected_by_the_parser() -> None:
    parser = argparse.ArgumentParser()
    add_transfer_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--transfer-backend", "carrier-pigeon"])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"backend": "nfs"}, "nfs"),
        ({"heartbeat_timeout": 0}, "--transfer-heartbeat-timeout"),
        ({"heartbeat_interval": 2.0, "heartbeat_timeout": 1.0}, "--transfer-heartbeat-timeout"),
        ({"max_batch_entries": 5000}, "--transfer-max-batch-entries"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TransferConfig(**kwargs)


def test_mooncake_port_range_reaches_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MC_MIN_RPC_PORT", raising=False)
    monkeypatch.delenv("MC_MAX_RPC_PORT", raising=False)
    TransferConfig(rpc_port_min=21000, rpc_port_max=21100).apply_mooncake_env()
    import os

    assert (os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"]) == ("21000", "21100")


def test_mooncake_tcp_connection_pool_is_on_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("MC_TCP_ENABLE_CONNECTION_POOL", raising=False)
    TransferConfig().apply_mooncake_env()
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "1"
    monkeypatch.setenv("MC_TCP_ENABLE_CONNECTION_POOL", "0")
    TransferConfig().apply_mooncake_env()
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "0"
