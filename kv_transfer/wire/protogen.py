"""Generate the gRPC stubs for proto/kv_bootstrap.proto on first use.

Stubs are never committed. On first import they are generated with grpcio-tools into a cache
folder keyed by the SHA-256 of the .proto file and the grpcio-tools/protobuf versions, so a
changed proto or an upgraded toolchain regenerates them and concurrent processes are safe
(generation happens in a temporary folder that is renamed into place atomically).

Where the .proto is looked for, in order:
  1. $SPLITSERVE_PROTO_DIR;
  2. <repo>/proto/ next to this package (clean clones, editable installs, and wheels, which ship
     proto/ at their root);
  3. <sys.prefix>/share/splitserve/proto/ (older installs).
The cache folder is $SPLITSERVE_CACHE_DIR, else $XDG_CACHE_HOME/splitserve, else
~/.cache/splitserve; a temporary folder is used when none of these is writable.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from kv_transfer.wire.errors import ConfigError

PROTO_NAME = "kv_bootstrap"
_lock = threading.Lock()
_loaded: tuple[ModuleType, ModuleType] | None = None


def find_proto_dir() -> Path:
    """The folder holding kv_bootstrap.proto (see the module docstring for the search order)."""
    candidates: list[Path] = []
    env = os.environ.get("SPLITSERVE_PROTO_DIR")
    if env:
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[2] / "proto")
    candidates.append(Path(sys.prefix) / "share" / "splitserve" / "proto")
    for folder in candidates:
        if (folder / f"{PROTO_NAME}.proto").is_file():
            return folder
    raise ConfigError(
        f"{PROTO_NAME}.proto not found in {', '.join(str(c) for c in candidates)}; "
        "reinstall splitserve or set SPLITSERVE_PROTO_DIR to the repository's proto/ folder"
    )


def _cache_root() -> Path:
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "splitserve"


def _stub_key(proto_file: Path) -> str:
    import google.protobuf
    import grpc_tools

    digest = hashlib.sha256(proto_file.read_bytes())
    digest.update(getattr(grpc_tools, "__version__", "?").encode())
    digest.update(google.protobuf.__version__.encode())
    return digest.hexdigest()[:24]


def _generate(proto_dir: Path, out_dir: Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto_dir / f"{PROTO_NAME}.proto"),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise ConfigError(f"grpc_tools.protoc failed with exit code {rc} on {proto_dir}")


def _ensure_generated(proto_dir: Path) -> Path:
    key = _stub_key(proto_dir / f"{PROTO_NAME}.proto")
    roots = [_cache_root(), Path(tempfile.gettempdir()) / f"splitserve-{os.getuid()}"]
    last_error: OSError | None = None
    for root in roots:
        target = root / "proto" / key
        if (target / f"{PROTO_NAME}_pb2_grpc.py").is_file():
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
            try:
                _generate(proto_dir, staging)
                os.replace(staging, target)  # atomic; loses the race harmlessly
            except OSError:
                if not (target / f"{PROTO_NAME}_pb2_grpc.py").is_file():
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return target
        except OSError as exc:
            last_error = exc
    raise ConfigError(f"cannot write generated gRPC stubs to {roots}: {last_error}")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stubs() -> tuple[ModuleType, ModuleType]:
    """(messages module, grpc services module), generating them on first call."""
    global _loaded
    with _lock:
        if _loaded is None:
            folder = _ensure_generated(find_proto_dir())
            pb2 = _load(f"{PROTO_NAME}_pb2", folder / f"{PROTO_NAME}_pb2.py")
            pb2_grpc = _load(f"{PROTO_NAME}_pb2_grpc", folder / f"{PROTO_NAME}_pb2_grpc.py")
            _loaded = (pb2, pb2_grpc)
        return _loaded
