"""Which CPU GEMM is faster on this host, timed when a model loads: the few-rows kernel against ``F.linear``
(MKL) or oneDNN's packed GEMM row count by row count (``calibrate_rows``), oneDNN against MKL at a prefill
chunk's rows (``onednn_beats_mkl``), and MKL on widened bfloat16 operands against the kernel
(``widened_wins``). The answers depend on the host (on an AMD EPYC with AVX-512 the kernel was 1.6-2.8x faster
than MKL even for one row, and with its tiles 1.5-2x MKL from 17 to 64 rows on a Zen 5 host; an earlier host's MKL
was as fast for 1-3 rows), so each is measured once per host and shared by every process on it
(row_calibration.py); linear.py routes each layer's row counts by them."""
from __future__ import annotations

import ctypes
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models import cpu_gemm, row_calibration

log = logging.getLogger(__name__)

# row counts timed at load: each one up to 32, then samples that stand for the counts since the one before, up to
# a batch-64 decode step. The kernel takes up to MAX_ROWS and beat MKL up to 200 rows on a Zen 5 host (1.5x), but
# oneDNN beat it from ~30 rows there (SmolLM2's 30 layers and LM head at 64 rows: 53.5 ms, the kernel 62.4, MKL
# 114.3) and takes the counts past 64, where prefill chunks start.
CALIBRATE_ROWS = (*range(1, 33), 40, 48, 56, 64)
# the output-lanes GEMM's go on to 256 rows, short prompts' prefill chunks: over SmolLM2's 30 layers' shapes on a Zen 4
# host, in bfloat16 it beat oneDNN's packed GEMM by 1.10x at 96 rows, 1.06x at 128, 1.03x at 192 and 1.01x at 256
# (383-403 against 347-387 GFLOP/s), in float32 by 1.12x at 128 rows and 1.09x at 256. Sampled more sparsely (its
# time moves with its 8-row tiles, not row by row): every count from 1 to 256 timed made the 150M model's first
# float32 load 9.5 s against 1.3 with the answer cached (the same host)
LANES_CALIBRATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 96, 128, 192, 256)
CALIBRATE_MIN = 1 << 20  # weights with fewer elements are not timed
# their row counts: 1-3 rows stay on MKL's single-row path for them, as before calibration (with the kernel there
# too, the tiny model's PD logprobs differed from the colocated server's in the 4th decimal: not yet understood)
DEFAULT_ROWS = frozenset(range(4, 21))
BIG_ROWS = 512  # a prefill chunk's rows, where MKL and oneDNN are compared
LLC_DEFAULT = 32 << 20  # bytes of last-level cache assumed where the OS does not say
CLEAR = 2.0  # a row count whose first timing has one side this many times the other is decided then


# a call that takes this long is timed once (after its untimed one): its time is the work's, not the timer's, and
# each calibration's median over passes already outvotes a disturbed one. The output-lanes GEMM's calibration over
# SmolLM2's working set took most of a float32 server's first start on a Zen 3 host (3.7 of 11 s; 4.6 s cached),
# its counts from 192 rows 20-60 ms a call
LONG_CALL = 0.02


def best_of(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` timed calls (one where a call takes LONG_CALL or more), after one untimed."""
    start = time.perf_counter()
    fn()
    if time.perf_counter() - start >= LONG_CALL:
        reps = 1
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrated_counts(lib: ctypes.CDLL, dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts a calibration times in ``dtype``: CALIBRATE_ROWS, or every count the kernel takes where
    that is a few."""
    top = cpu_gemm.max_rows(lib, dtype)
    return CALIBRATE_ROWS if top == cpu_gemm.MAX_ROWS else tuple(range(1, top + 1))


def onednn_beats_mkl(weight: torch.Tensor, reps: int = 3, passes: int = 3) -> bool:
    """Whether oneDNN's GEMM on the dense ``weight`` is faster than ``F.linear`` (MKL) at BIG_ROWS rows here:
    the median over ``passes`` of each one's best of ``reps``, once per host (``row_calibration``)."""
    if not cpu_gemm.can_prepack(weight.device, torch.float32):
        return False
    return _beats_mkl(weight, "onednn-dense-vs-mkl", lambda: lambda x: cpu_gemm.onednn_linear(x, weight, None),
                      reps, passes)


def lanes_beats_mkl(lib: ctypes.CDLL, weight: torch.Tensor, reps: int = 3, passes: int = 3) -> bool:
    """Whether the output-lanes GEMM (on a copy of ``weight`` in its layout) is faster than ``F.linear`` (MKL) at
    BIG_ROWS rows here, as ``onednn_beats_mkl``. Where oneDNN does not beat MKL (a Zen 3 host, 2 threads: SmolLM2's
    30 layers' shapes at 512 rows, MKL 642 ms, oneDNN's packed GEMM 686), this is what lets a float32 model take the
    lanes GEMM (linear.packs_float32_for_lanes; there 597 ms, and 154 against MKL's 193 at 128 rows)."""
    def contender() -> Callable[[torch.Tensor], torch.Tensor]:
        copy = cpu_gemm.lanes_pack(weight)
        return lambda x: cpu_gemm.lanes_gemm(lib, x, copy, weight.shape[0], None)
    return _beats_mkl(weight, Path(lib._name).stem + "-lanes-vs-mkl", contender, reps, passes)


def _beats_mkl(weight: torch.Tensor, name: str, contender: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
               reps: int, passes: int) -> bool:
    """Whether ``contender()``'s function of x beats ``F.linear(x, weight)`` at BIG_ROWS rows: the median over
    ``passes`` of the time each one's best of ``reps`` saves, measured once per host under ``name``."""
    def measure() -> frozenset[int]:
        x = torch.randn(BIG_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
        try:
            fn = contender()
            with torch.inference_mode():
                saved = [best_of(lambda: F.linear(x, weight), reps) - best_of(lambda: fn(x), reps)
                         for _ in range(passes)]
        except RuntimeError as e:  # a oneDNN build that packs but refuses this call: MKL it is
            log.info("%s: the contender is not usable here (%s): MKL's GEMM takes prefill", name,
                     str(e).splitlines()[0])
            return frozenset()
        return frozenset({BIG_ROWS}) if statistics.median(saved) > 0 else frozenset()
    return bool(row_calibration.cached_rows(row_calibration.key(tuple(weight.shape), name), measure))


def widened_wins(lib: ctypes.CDLL, weight: torch.Tensor, reps: int = 2, passes: int = 3) -> frozenset[int]:
    """``{WIDEN_ROWS}`` where ``widened_linear`` beat the kernel (in pieces) at that many rows on ``weight`` (the
    median of ``passes``, each the best of ``reps``), else nothing: a row_calibration answer."""
    rows = cpu_gemm.WIDEN_ROWS
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        saved = [best_of(lambda: cpu_gemm.few_rows_gemm(lib, x, weight, None), reps)
                 - best_of(lambda: cpu_gemm.widened_linear(x, weight, None), reps) for _ in range(passes)]
    return frozenset({rows}) if statistics.median(saved) > 0 else frozenset()


def _every_weight(fn: Callable[[torch.Tensor, int], torch.Tensor], weights: list[torch.Tensor],
                  xs: dict[int, torch.Tensor]) -> Callable[[], None]:
    """A call of ``fn`` on each weight in turn (with the input of its width and its index): what is timed."""
    def run() -> None:
        for i, w in enumerate(weights):
            fn(xs[w.shape[1]], i)
    return run


# the output-lanes GEMM takes every row count above those it was calibrated for (in pieces of MAX_ROWS) where at
# BIG_ROWS rows over the working set it took no more than this times the packed GEMM's time: then every step can
# run in the native layer stack (engine/runner/layer_stack.py), and no packed copy is kept. SmolLM2 on a Zen 4
# host, 2 threads, SmolLM2's 120 weights: the two level at 512 and 2,048 rows in both dtypes (the packed GEMM
# 1.00-1.03x the lanes GEMM's time); in the engine, a 512-token prompt's prefill 1.016x (bfloat16) and 1.055x
# (float32) faster with the stack, a 4 x 512-token step 1.004-1.005x, PSS after load 205 / 548 MB less
BEYOND_TIE = 1.03


def lanes_beyond(weights: list[torch.Tensor], lanes: Callable[[torch.Tensor, int], torch.Tensor],
                 packed: Callable[[torch.Tensor, int], torch.Tensor], reps: int = 2,
                 passes: int = 3) -> frozenset[int]:
    """``{BIG_ROWS}`` where ``lanes`` (called with the input and the weight's index) took at most BEYOND_TIE times
    ``packed``'s time at BIG_ROWS rows over ``weights`` (the median ratio of ``passes``, each the best of
    ``reps``), else nothing: a row_calibration answer."""
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(BIG_ROWS, k, generator=g).to(weights[0].dtype) for k in sorted({w.shape[1] for w in weights})}
    with torch.inference_mode():
        ratios = [best_of(_every_weight(lanes, weights, xs), reps) / best_of(_every_weight(packed, weights, xs), reps)
                  for _ in range(passes)]
    return frozenset({BIG_ROWS}) if statistics.median(ratios) <= BEYOND_TIE else frozenset()


def calibrate_rows(lib: ctypes.CDLL, weights: list[torch.Tensor], reps: int = 3, passes: int = 3,
                   baseline: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                   counts: tuple[int, ...] = CALIBRATE_ROWS,
                   kernel: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> frozenset[int]:
    """The row counts in ``counts`` where ``kernel`` (the few-rows kernel on the dense weight; called as
    ``baseline``) beats ``baseline`` (``F.linear``; called with the input and the weight's index) over ``weights``
    (``working_set``: each count's time is all of them in turn) here. ``passes`` sweeps over the counts, each
    timing both ``reps`` times (best of each); a count's saving is its median over the passes, so a disturbance
    during one sweep (another worker loading its model on the same cores) does not decide; then the counts from 1
    up to the one where the time saved in all is the largest (``best_prefix``, a sampled
    count weighted by the counts it stands for, and standing for all of them in the result), so one noisy count
    cannot punch a hole in the range or add a stray one, and every count up to the kernel's last takes the kernel:
    its result for a row does not depend on how many rows came with it, MKL's differs from it in the last bits, so a
    hole at 1 row (MKL there, the kernel from 2) made a request's sampled tokens depend on its batch and on
    speculation (a decode worker verifying 4 draft rows against a colocated server's 1-row steps). A count where one
    side took CLEAR times the other's time in the first sweep is not swept again: a gap that wide is no disturbance,
    and timing it twice more was most of a first load's calibration where the baseline is slow (an AVX2-only Zen 1
    host, the 150M model's bfloat16 weights against ``F.linear``: 6.5 s). About a second, once per host
    (``row_calibration``)."""

    base = baseline or (lambda x, i: F.linear(x, weights[i]))
    ours = kernel or (lambda x, i: cpu_gemm.few_rows_gemm(lib, x, weights[i], None))
    g = torch.Generator().manual_seed(0)
    widths = sorted({w.shape[1] for w in weights})
    inputs = {m: {k: torch.randn(m, k, generator=g).to(weights[0].dtype) for k in widths} for m in counts}
    saved: dict[int, list[float]] = {m: [] for m in counts}
    clear: set[int] = set()
    with torch.inference_mode():
        for _ in range(passes):
            for m, xs in inputs.items():
                if m in clear:
                    continue
                base_s = best_of(_every_weight(base, weights, xs), reps)
                kernel_s = best_of(_every_weight(ours, weights, xs), reps)
                saved[m].append(base_s - kernel_s)
                if len(saved[m]) == 1 and max(base_s, kernel_s) >= CLEAR * min(base_s, kernel_s):
                    clear.add(m)
    return best_prefix({m: statistics.median(v) for m, v in saved.items()})


def last_level_cache() -> int:
    """The largest CPU cache's size in bytes (Linux's sysfs), or LLC_DEFAULT."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip() if f.is_file() else ""
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=LLC_DEFAULT)


def working_set(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weights a calibration times together: the model's own, in order, until they hold a quarter more than
    the CPU's last-level cache, so taken in turn each is read from memory, as in a step of a model larger than
    the caches (all of them for a model that fits). Timed alone, one 3,072 x 576 weight stays in the cache: in
    bfloat16 the kernel then beat oneDNN's packed GEMM at 1-2 rows only, where over SmolLM2's 30 layers it was
    1.1-1.6x faster at 1-11."""
    limit, total, out = last_level_cache() * 5 // 4, 0, []
    for w in weights:
        out.append(w)
        total += w.numel() * w.element_size()
        if total >= limit:
            break
    return out


def kernel_key(lib: ctypes.CDLL, timed: list[torch.Tensor]) -> str:
    """The kernel's part of a calibration key: the compiled library and the working set's size."""
    return f"{Path(lib._name).stem}-{sum(w.numel() * w.element_size() for w in timed) >> 20}MB"


def _stands_for(counts: list[int]) -> dict[int, range]:
    """Each sampled row count and the counts it stands for: those after the sample before it, up to itself."""
    return {m: range(prev + 1, m + 1) for prev, m in zip([0, *counts], counts)}


def best_prefix(saved: dict[int, float]) -> frozenset[int]:
    """The row counts from 1 up to the key (in order) where the sum of ``saved`` is the largest and positive, or
    none; a key counts for the row counts it stands for (``_stands_for``), and the result holds all of them."""
    spans = _stands_for(sorted(saved))
    best, best_sum, total = frozenset(), 0.0, 0.0
    for m in sorted(saved):
        total += saved[m] * len(spans[m])
        if total > best_sum:
            best, best_sum = frozenset(range(1, m + 1)), total
    return best


def ranges(rows: frozenset[int]) -> str:
    """1-3, 5, 7-20"""
    out, run = [], []
    for r in sorted(rows):
        if run and r != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(r)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
