"""One few-rows calibration per host: the row counts a kernel won at, measured once and kept on disk.

``linear.calibrate_rows`` times the few-rows kernel against ``F.linear`` at load. Timed in each process, two
workers on one host could choose differently near the boundary (a row count the kernel wins by 2% in one and
loses by 1% in the other), and the two paths round differently in the last bits: a PD decode worker's logprobs
would then differ from a colocated server's for no reason a user could see. So the first process to calibrate a
key measures under an exclusive file lock (which also keeps two processes from timing at once and disturbing each
other), writes the result, and every later process on the host reads it. The key names everything the timing
depends on: the weight's shape, torch's thread count and version, the compiled kernel, and the CPU's model and
flags. Delete the file (``path()``) to measure again."""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
FILE = "few-rows-calibration.json"


def path() -> Path:
    from engine.tiny_model import default_cache_dir
    return default_cache_dir() / "kernels" / FILE


def cpu_identity() -> str:
    """A short digest of the CPU's model name and feature flags (Linux's /proc/cpuinfo; else the platform)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        wanted = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
        text = "\n".join(dict.fromkeys(wanted))
    except OSError:
        import platform
        text = platform.processor() or platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def key(shape: tuple[int, int], kernel: str) -> str:
    return (f"{shape[0]}x{shape[1]} threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernel} "
            f"cpu={cpu_identity()}")


def cached_rows(key: str, measure: Callable[[], frozenset[int]], file: Path | None = None) -> frozenset[int]:
    """The rows stored under ``key``, or ``measure()``'s, stored for the next process. Any trouble with the file
    (read-only cache, corrupt JSON) falls back to measuring in this process, with a warning."""
    file = file or path()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(file.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = _read(file)
            if key in table:
                return frozenset(table[key])
            rows = measure()
            table[key] = sorted(rows)
            tmp = file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, file)
            return rows
    except OSError as e:
        log.warning("few-rows calibration not shared through %s (%s): measured in this process only", file, e)
        return measure()


def _read(file: Path) -> dict[str, list[int]]:
    try:
        table = json.loads(file.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        log.warning("%s is not valid JSON: calibrating again", file)
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items()
            if isinstance(v, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in v)}
