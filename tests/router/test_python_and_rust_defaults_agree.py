"""A default is declared once (Rust RouterConfig::default); the Python front must agree with
it field by field, and the CLI of ARCHITECTURE.md must parse into the config Rust accepts."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from router import _router
from router.config import RouterArgs, build_parser, parse_args


def test_every_rust_field_has_a_python_field_with_the_same_default() -> None:
    rust = json.loads(_router.defaults_json())
    py = dataclasses.asdict(RouterArgs())
    assert list(py) == list(rust), "same fields, same order"
    assert py == rust
    parsed = dataclasses.asdict(parse_args([]))
    assert parsed == rust, "the CLI parser's defaults are the Rust defaults"
    assert json.loads(_router.validate_config(RouterArgs().to_json())) == rust


def test_architecture_cli_parses_into_a_valid_config() -> None:
    args = parse_args(["--pd-disaggregation", "--prefill", "http://h:30100", "8998", "--prefill", "http://h2:30100",
                       "--decode", "http://h:30200", "--decode", "http://h3:30200", "--port", "8000",
                       "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two", "--host", "0.0.0.0"])
    cfg = json.loads(_router.validate_config(args.to_json()))
    assert cfg["prefill"] == [{"url": "http://h:30100", "bootstrap_port": 8998}, {"url": "http://h2:30100", "bootstrap_port": None}]
    assert cfg["decode"] == ["http://h:30200", "http://h3:30200"]
    assert (cfg["port"], cfg["host"], cfg["decode_policy"]) == (8000, "0.0.0.0", "power_of_two")
    regular = parse_args(["--worker-urls", "http://a:1", "http://b:2", "--policy", "round_robin"])
    assert json.loads(_router.validate_config(regular.to_json()))["worker_urls"] == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize("argv,needle", [
    (["--worker-urls", "a:1"], "must start with http://"),
    (["--pd-disaggregation", "--prefill", "http://a:1"], "--decode"),
    (["--prefill", "http://a:1", "--decode", "http://b:1"], "--pd-disaggregation"),
    (["--cache-threshold", "2"], "--cache-threshold"),
    (["--service-discovery", "--k8s-api-url", "https://k8s"], "kubectl proxy"),
])
def test_bad_configs_are_refused_with_the_flag_to_fix(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match="invalid router configuration") as e:
        _router.validate_config(parse_args(argv).to_json())
    assert needle in str(e.value)


def test_bad_prefill_port_and_unknown_policy_are_cli_errors() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefill", "http://a:1", "port"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy", "fastest"])


def test_module_and_console_script_are_the_same_command() -> None:
    out = subprocess.run([sys.executable, "-m", "router.launch_router", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--pd-disaggregation" in out.stdout and "--prefill URL" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "router.launch_router", "--worker-urls", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must start with http://" in bad.stderr
