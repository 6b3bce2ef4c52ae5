"""gRPC stubs come from proto/ at first import (cached by the proto's hash), never from committed files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _import_in_fresh_process(cache: Path, proto_dir: Path | None = None) -> str:
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    if proto_dir is not None:
        env["SPLITSERVE_PROTO_DIR"] = str(proto_dir)
    code = ("from kv_transfer.wire.protogen import stubs; pb2, grpc_mod = stubs(); "
            "print(pb2.__file__); assert hasattr(grpc_mod, 'KVBootstrapStub')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_no_generated_stubs_are_committed() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
    assert "_pb2" not in tracked


def test_stubs_generated_into_cache_keyed_by_proto_hash(tmp_path: Path) -> None:
    first = _import_in_fresh_process(tmp_path / "cache")
    assert first.startswith(str(tmp_path / "cache"))
    assert _import_in_fresh_process(tmp_path / "cache") == first  # reused, not regenerated

    changed = tmp_path / "proto"
    changed.mkdir()
    text = (REPO / "proto" / "kv_bootstrap.proto").read_text()
    (changed / "kv_bootstrap.proto").write_text(text + "\n// a changed proto gets new stubs\n")
    second = _import_in_fresh_process(tmp_path / "cache", changed)
    assert Path(second).parent != Path(first).parent
