"""A worker's API key may come from $SPLITSERVE_API_KEY or --api-key-file instead of the command line (where any
user of the host can read it from the process list); /health stays open, everything else needs the key. An empty
or missing key file stops the worker at start with a message naming it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers import ServerProcess


def test_worker_api_key_can_come_from_env_or_a_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "worker.key"
    key_file.write_text("file-key\n")
    base = ["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096"]
    servers = [(ServerProcess("engine", base, env={"SPLITSERVE_API_KEY": "env-key"}), "env-key"),
               (ServerProcess("engine", [*base, "--api-key-file", str(key_file)]), "file-key")]
    try:
        for srv, key in servers:
            srv.wait_ready()
            body = {"prompt": "hi", "max_tokens": 1}
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 401
            ok = httpx.post(srv.url + "/v1/completions", json=body, timeout=30,
                            headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
            assert key not in " ".join(srv.proc.args)
    finally:
        for srv, _ in servers:
            srv.stop()
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    for bad in (empty, tmp_path / "missing.key"):
        done = subprocess.run([sys.executable, "-m", "engine", *base, "--api-key-file", str(bad)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and str(bad) in done.stderr, done.stderr[-500:]
