"""The router's configuration as one frozen dataclass, and the CLI parser built from it.

Every default is declared once, in Rust (`RouterConfig::default()` in router/core/src/config.rs);
this module reads them from the extension, so the Python front cannot drift from it
(tests/router/test_python_and_rust_defaults_agree.py checks field by field).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router import _router

DEFAULTS: dict[str, Any] = json.loads(_router.defaults_json())
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def _d(name: str, help_text: str, **meta: Any) -> Any:
    """A dataclass field whose default is the Rust default of the same name."""
    value = DEFAULTS[name]
    meta["help"] = help_text
    if isinstance(value, list):
        return field(default_factory=lambda: list(value), metadata=meta)
    return field(default=value, metadata=meta)


@dataclass(frozen=True)
class RouterArgs:
    host: str = _d("host", "address to listen on")
    port: int = _d("port", "port to listen on")
    worker_urls: list[str] = _d("worker_urls", "regular mode: worker URLs", nargs="*")
    pd_disaggregation: bool = _d("pd_disaggregation", "PD mode: route to --prefill and --decode workers")
    prefill: list[dict[str, Any]] = _d("prefill", "PD mode: a prefill worker URL, optionally followed by its bootstrap port (repeatable)", special="prefill")
    decode: list[str] = _d("decode", "PD mode: a decode worker URL (repeatable)", special="decode")
    policy: str = _d("policy", "routing policy (regular mode; default for PD roles)", choices=POLICIES)
    prefill_policy: str | None = _d("prefill_policy", "PD mode: policy for prefill workers (default: --policy)", choices=POLICIES)
    decode_policy: str | None = _d("decode_policy", "PD mode: policy for decode workers (default: --policy)", choices=POLICIES)
    cache_threshold: float = _d("cache_threshold", "cache_aware: minimum matched share of the text for affinity")
    balance_abs_threshold: int = _d("balance_abs_threshold", "cache_aware: a worker is overloaded when its load exceeds the minimum by more than this ...")
    balance_rel_threshold: float = _d("balance_rel_threshold", "cache_aware: ... and is more than this times the minimum")
    eviction_interval_secs: float = _d("eviction_interval_secs", "cache_aware: seconds between LRU evictions of the prefix tree")
    max_tree_size: int = _d("max_tree_size", "cache_aware: bytes of request text kept per worker")
    load_poll_interval_secs: float = _d("load_poll_interval_secs", "power_of_two: seconds between /get_load polls")
    max_payload_size: int = _d("max_payload_size", "largest request body in bytes (413 above)")
    max_header_size: int = _d("max_header_size", "largest total size of the request line and headers in bytes (431 above)")
    request_timeout_secs: float = _d("request_timeout_secs", "whole-request deadline (504)")
    stall_timeout_secs: float = _d("stall_timeout_secs", "a stream that sends nothing for this long is ended with an error and its worker taken out of rotation")
    max_concurrent_requests: int = _d("max_concurrent_requests", "requests forwarded at once; 0 = no limit")
    queue_size: int = _d("queue_size", "requests waiting for a slot (429 when full)")
    queue_timeout_secs: float = _d("queue_timeout_secs", "longest wait for a slot (408 after)")
    max_retries: int = _d("max_retries", "retries on another worker/pair, only before the first byte reached the client")
    retry_initial_backoff_ms: int = _d("retry_initial_backoff_ms", "first retry delay")
    retry_max_backoff_ms: int = _d("retry_max_backoff_ms", "largest retry delay")
    retry_backoff_multiplier: float = _d("retry_backoff_multiplier", "delay growth per retry")
    retry_jitter: float = _d("retry_jitter", "relative jitter of retry delays, 0..1")
    health_check_interval_secs: float = _d("health_check_interval_secs", "seconds between health checks")
    health_check_timeout_secs: float = _d("health_check_timeout_secs", "health check deadline")
    health_failure_threshold: int = _d("health_failure_threshold", "consecutive failed checks before a worker is taken out")
    health_success_threshold: int = _d("health_success_threshold", "consecutive good checks before it is taken back")
    health_check_endpoint: str = _d("health_check_endpoint", "worker path probed by health checks")
    cb_failure_threshold: int = _d("cb_failure_threshold", "circuit breaker: consecutive request failures that open it; 0 = off")
    cb_success_threshold: int = _d("cb_success_threshold", "circuit breaker: half-open successes that close it")
    cb_timeout_secs: float = _d("cb_timeout_secs", "circuit breaker: seconds open before a trial request")
    api_key: str | None = _d("api_key", "require `Authorization: Bearer KEY` (all routes but /health, /liveness, /readiness)")
    worker_api_key: str | None = _d("worker_api_key", "send `Authorization: Bearer KEY` to every worker (their --api-key) instead of the client's header")
    shutdown_grace_period_secs: float = _d("shutdown_grace_period_secs", "on SIGTERM, how long in-flight requests may finish")
    log_level: str = _d("log_level", "trace, debug, info, warn or error")
    worker_threads: int = _d("worker_threads", "async runtime threads; 0 = one per available core")
    service_discovery: bool = _d("service_discovery", "discover workers from Kubernetes pods")
    selector: list[str] = _d("selector", "discovery: label selector key=value for regular workers", nargs="*")
    prefill_selector: list[str] = _d("prefill_selector", "discovery: label selector for prefill pods", nargs="*")
    decode_selector: list[str] = _d("decode_selector", "discovery: label selector for decode pods", nargs="*")
    service_discovery_namespace: str = _d("service_discovery_namespace", "discovery: namespace to watch")
    service_discovery_port: int = _d("service_discovery_port", "discovery: worker HTTP port on each pod")
    bootstrap_port_annotation: str = _d("bootstrap_port_annotation", "discovery: pod annotation holding a prefill pod's bootstrap port")
    k8s_api_url: str | None = _d("k8s_api_url", "discovery: Kubernetes API base URL (plain http, e.g. a kubectl proxy sidecar; default http://127.0.0.1:8001)")
    discovery_relist_interval_secs: float = _d("discovery_relist_interval_secs", "discovery: full re-list at least this often")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


class _PrefillAction(argparse.Action):
    """`--prefill URL [BOOTSTRAP_PORT]`, repeatable."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if not 1 <= len(values) <= 2:
            parser.error("--prefill takes a URL and optionally its bootstrap port: --prefill http://HOST:30100 8998")
        port = None
        if len(values) == 2 and values[1].lower() != "none":
            try:
                port = int(values[1])
            except ValueError:
                parser.error(f"--prefill {values[0]} {values[1]}: the bootstrap port must be an integer")
        items = list(getattr(namespace, self.dest) or [])
        items.append({"url": values[0], "bootstrap_port": port})
        setattr(namespace, self.dest, items)


def _type_of(f: dataclasses.Field) -> type:
    default = DEFAULTS[f.name]
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_router",
        description="SplitServe router. Regular mode: --worker-urls URL... ; PD mode: "
                    "--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] ... --decode URL ...",
    )
    for f in dataclasses.fields(RouterArgs):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        special = meta.pop("special", None)
        default = DEFAULTS[f.name]
        if special == "prefill":
            p.add_argument(flag, dest=f.name, nargs="+", action=_PrefillAction, default=[],
                           metavar=("URL", "BOOTSTRAP_PORT"), help=help_text)
        elif special == "decode":
            p.add_argument(flag, dest=f.name, action="append", default=[], metavar="URL", help=help_text)
        elif isinstance(default, bool):
            p.add_argument(flag, dest=f.name, action="store_true", default=default, help=help_text)
        elif "nargs" in meta:
            p.add_argument(flag, dest=f.name, nargs=meta["nargs"], default=list(default), help=help_text)
        else:
            kind = _type_of(f) if default is not None else (float if f.name.endswith("_secs") else str)
            p.add_argument(flag, dest=f.name, type=kind, default=default, choices=meta.get("choices"),
                           help=f"{help_text} (default: {default})")
    return p


API_KEY_ENV = "SPLITSERVE_ROUTER_API_KEY"
WORKER_API_KEY_ENV = "SPLITSERVE_WORKER_API_KEY"
_SECRETS = {"api_key": API_KEY_ENV, "worker_api_key": WORKER_API_KEY_ENV}


def parse_args(argv: list[str] | None = None) -> RouterArgs:
    """The command line; each key may also come from its environment variable ($SPLITSERVE_ROUTER_API_KEY,
    $SPLITSERVE_WORKER_API_KEY) or a file (--api-key-file, --worker-api-key-file), so that it need not be
    visible in the process list."""
    parser = build_parser()
    for name, env in _SECRETS.items():
        flag = name.replace("_", "-")
        parser.add_argument(f"--{flag}-file", default=None, help=f"read --{flag} from this file (or set ${env})")
    ns = vars(parser.parse_args(argv))
    for name, env in _SECRETS.items():
        key_file, flag = ns.pop(f"{name}_file"), name.replace("_", "-")
        key = ns[name] or os.environ.get(env) or None
        if key is None and key_file:
            try:
                key = Path(key_file).read_text().strip()
            except OSError as e:
                parser.error(f"--{flag}-file {key_file}: {e.strerror}")
            if not key:
                parser.error(f"--{flag}-file {key_file} is empty")
        ns[name] = key
    return RouterArgs(**ns)
