"""Native CPU kernels: a C source compiled on first use with the system C compiler into the user's cache folder
(keyed by source, the shared headers beside this file and those beside the source, compiler and flags) and loaded
with ctypes, which releases the GIL during calls. Without a compiler (or with SPLITSERVE_DISABLE_NATIVE_KERNELS=1)
callers get None and take their pure-torch path."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# FMAs and reassociated (tree) reductions in the dot products; no errno, no trapping math
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast",
         "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
_INCLUDE = Path(__file__).parent  # headers the kernels share (vec16.h); part of the cache key, as are a source's own
_loaded: dict[Path, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    from engine.tiny_model import default_cache_dir
    return default_cache_dir() / "kernels"


def _build(source: Path) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: %s is not used (the slower pure-torch path is)", source.name)
        return None
    headers = b"".join(h.read_bytes() for h in sorted({*_INCLUDE.glob("*.h"), *source.parent.glob("*.h")}))
    digest = hashlib.sha256(source.read_bytes() + headers + cc.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run([cc, *FLAGS, f"-I{_INCLUDE}", str(source), "-o", str(out), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                log.warning("compiling %s failed (using pure torch): %s", source.name, proc.stderr[-2000:])
                return None
            os.replace(out, target)
    return ctypes.CDLL(str(target))


def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library of ``source`` (built once per process, cached on disk), or None."""
    if source not in _loaded:
        lib = None
        if os.environ.get("SPLITSERVE_DISABLE_NATIVE_KERNELS") != "1":
            try:
                lib = _build(source)
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("native kernel %s unavailable (using pure torch): %s", source.name, e)
        _loaded[source] = lib
    return _loaded[source]
