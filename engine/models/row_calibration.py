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
each pod measures once. SPLITSERVE_RECALIBRATE=1 (or deleting the file, ``path()``) measures again.

Since the answer is kept, a measurement that other processes disturbed would slow the host for good: on a 2-core
AMD EPYC (Zen 4) a stored bfloat16 answer of 1-2 rows (measured at the host's first load, while other work ran)
sent 3-11 rows to oneDNN's packed GEMM, where a quiet measurement gives 1-10 or 1-11: a batch-1 verification of 4
drafts took 2.1x a plain step instead of ~1.2x and n-gram speculation gave 1.18x instead of 1.48x (bench_spec,
SmolLM2 bfloat16, copy workload). So the share of our cores that other processes used while it measured
(``others_share``: /proc/stat, steal included, against this process's own CPU time) is checked, and a measurement
over QUIET_SHARE is taken again, up to QUIET_TRIES times, QUIET_PAUSE_S apart; the last one is kept if the host
stays busy. Processes waiting for the lock sleep, so they do not count against it."""
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
LOCK_WAIT_S = 30.0  # a calibration takes well under a second (QUIET_TRIES of them, at worst, a few seconds)
QUIET_SHARE = 0.15  # other processes' share of our cores above which a measurement is disturbed
QUIET_TRIES = 3
QUIET_PAUSE_S = 0.5  # between tries: a burst (another process starting) passes


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
            rows = measure_quietly(measure)
            table[key] = sorted(rows)
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, file)
            return rows
    except OSError as e:
        log.warning("few-rows calibration not shared through %s (%s): measured in this process only", file, e)
        return rows if rows is not None else measure()
    finally:
        tmp.unlink(missing_ok=True)


def measure_quietly(measure: Callable[[], frozenset[int]],
                    share: Callable[[Callable[[], frozenset[int]]], tuple[frozenset[int], float | None]] | None = None,
                    ) -> frozenset[int]:
    """``measure()``, again (up to QUIET_TRIES in all) while other processes used over QUIET_SHARE of our cores
    during it. ``share`` runs a measurement and says how disturbed it was (default ``timed_share``)."""
    run = share or timed_share
    for attempt in range(1, QUIET_TRIES + 1):
        rows, busy = run(measure)
        if busy is None or busy <= QUIET_SHARE:
            return rows
        if attempt < QUIET_TRIES:
            log.info("few-rows calibration: other processes used %.0f%% of the cores while it measured; measuring "
                     "again", 100 * busy)
            time.sleep(QUIET_PAUSE_S)
    log.warning("few-rows calibration: the host stayed busy (other processes used %.0f%% of the cores in all %d "
                "tries); the last measurement is kept (SPLITSERVE_RECALIBRATE=1 measures again)", 100 * busy,
                QUIET_TRIES)
    return rows


def timed_share(measure: Callable[[], frozenset[int]]) -> tuple[frozenset[int], float | None]:
    """``measure()``'s result and the share of this process's cores other processes used meanwhile (None where
    /proc/stat cannot be read)."""
    before = _cpu_sample()
    rows = measure()
    return rows, others_share(before, _cpu_sample())


def others_share(before: tuple[float, float, float, int] | None,
                 after: tuple[float, float, float, int] | None) -> float | None:
    """From two ``_cpu_sample``s: the busy time of this process's CPUs not spent by this process, over the
    wall time those CPUs had."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    wall, busy, own = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    return max(0.0, busy - own) / (wall * after[3])


def _cpu_sample() -> tuple[float, float, float, int] | None:
    """(monotonic seconds, busy seconds of the CPUs this process may run on, this process's CPU seconds, CPUs)."""
    try:
        cpus = os.sched_getaffinity(0)
        lines = Path("/proc/stat").read_text().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus and len(fields) >= 8:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            busy += user + nice + system + irq + softirq + steal
    t = os.times()
    return time.monotonic(), busy / tick, t.user + t.system, len(cpus)


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
