"""One few-rows calibration per host: the row counts a kernel won at, measured once and kept on disk.

``gemm_timing.calibrate_rows`` times the few-rows kernel against ``F.linear`` at load. Timed in each process, two
workers on one host could choose differently near the boundary (a row count the kernel wins by 2% in one and
loses by 1% in the other), and the two paths round differently in the last bits: a PD decode worker's logprobs
would then differ from a colocated server's for no reason a user could see. So the first process to calibrate a
key measures under an exclusive file lock (which also keeps two processes from timing at once and disturbing each
other), writes the result, and every later process on the host reads it. The key names everything the timing
depends on: the weight's shape, torch's thread count and version, the compiled kernel, and the CPU's model and
flags. Processes that share a cache folder (``$SPLITSERVE_CACHE``, else ``$XDG_CACHE_HOME/splitserve``, else
``~/.cache/splitserve``) and a thread count share the answer; in the Helm chart each pod has its own cache, so
each pod measures once. SPLITSERVE_RECALIBRATE=1 (or deleting the file, ``path()``) measures again."""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

log = logging.getLogger(__name__)
FILE = "few-rows-calibration.json"
LOCK_WAIT_S = 30.0  # a calibration takes well under a second


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


# how a timing becomes rows (gemm_timing.best_prefix): answers stored under another rule are measured again
RULE = "from-1"


def key(shape: tuple[int, int], kernel: str) -> str:
    return (f"{shape[0]}x{shape[1]} threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernel} "
            f"cpu={cpu_identity()} rows={RULE}")


def cached_rows(key: str, measure: Callable[[], frozenset[int]], file: Path | None = None) -> frozenset[int]:
    """The rows stored under ``key``, or ``measure()``'s, stored for the next process. With
    SPLITSERVE_RECALIBRATE=1 the stored rows are measured again and replaced. Any trouble with the file (a
    read-only cache, corrupt JSON, a lock held past ``LOCK_WAIT_S``) falls back to measuring in this process,
    with a warning; a stored answer is still read from a read-only cache."""
    file = file or path()
    again = os.environ.get("SPLITSERVE_RECALIBRATE") == "1"
    if not again and key in (table := _read(file)):  # os.replace makes a lock-free read safe
        return frozenset(table[key])
    rows: frozenset[int] | None = None
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(file.with_suffix(".lock"), "a") as lock:
            _lock(lock)
            table = _read(file)
            if key in table and not again:  # another process measured while this one waited
                return frozenset(table[key])
            rows = measure()
            table[key] = sorted(rows)
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, file)
            return rows
    except OSError as e:
        log.warning("few-rows calibration not shared through %s (%s): measured in this process only", file, e)
        return rows if rows is not None else measure()
    finally:
        tmp.unlink(missing_ok=True)


def _lock(lock: IO[str]) -> None:
    """An exclusive lock on ``lock``, or TimeoutError (an OSError) after LOCK_WAIT_S: a process stopped while
    it measures must not hold up every later model load on the host."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process held the calibration lock for over {LOCK_WAIT_S:g} s")
            time.sleep(0.05)


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
