"""Linear layers whose weights are reordered once, at load, into the CPU GEMM's own blocked layout (oneDNN).

``F.linear`` repacks the whole weight on every call. At decode batch sizes (a few to a few hundred rows) that
repacking is a large share of the matmul: prepacked weights measured 1.2-1.7x faster in float32 and 1.6-2.5x in
bfloat16 (where oneDNN also uses AMX when the CPU has it) for 16-200 rows, and the same at 512 rows. This is
what torch.compile's CPU weight prepacking does; here it is done eagerly, without a compile step.

In float32 the answer depends on the host: on one (Intel) MKL's own GEMM behind ``F.linear`` was 10-16% faster
for prefill-sized steps (thousands of rows) and the decode gain a few percent; on an AMD EPYC (AVX-512, 2 cores)
the packed GEMM was 1.1-1.36x faster at 64, 512 and 4,096 rows (MKL takes a slow path from 2 to ~48 rows there),
which made a batch-64 SmolLM2 decode step 1.33x faster. But its rounding is not MKL's: on SmolLM2 the logits
then differ from transformers (which uses MKL) by up to 1.5e-4, against 6.9e-5 unpacked, over the 1e-4 the
real-model test allows. So by default (``auto``) only bfloat16 weights are packed; ``on`` packs float32 too.
Only CPU weights are packed.

Float32 weights that are not packed go through ``FewRowsLinear``: for few rows (a small decode batch, a
speculative verification) a native kernel (few_rows_gemm.c) reads each weight row once, where MKL's sgemm
packs the whole weight per call. So do bfloat16 weights oneDNN does not pack (a CPU without AVX-512, or
``--weight-prepack off``), for up to the kernel's bfloat16 row limit (11 with AVX-512 BF16; elsewhere, where
torch has no fast bfloat16 GEMM at all, the float32 tiles take bfloat16 weights at every count). Which row
counts it takes is measured when the model loads (``calibrate_rows``: counts from 1 to 64, CALIBRATE_ROWS, on
one of the model's own layer shapes, the kernel against ``F.linear``), because the answer depends on the host: on
an AMD EPYC (AVX-512) the kernel was 1.6-2.8x faster than MKL even for one row, and with its tiles 1.5-2x MKL from
17 to 64 rows on a Zen 5 host; an earlier host's MKL was as fast for 1-3 rows. The answer is measured once per
host and shared by every process on it (``row_calibration``).

The row counts the kernel does not take (prefill chunks, large decode batches) go to oneDNN's GEMM where it beats
MKL's behind ``F.linear`` here (``onednn_beats_mkl``, timed at BIG_ROWS rows once per host). On a Zen 5 host (2
cores) it ran SmolLM2's 3072 x 576 layer at 1,024 rows in 8.4 ms against MKL's 18.7 (429 against 194 GFLOP/s) on
the dense weight, which it reorders per call, and in 7.4 ms on a packed copy. The decoder layers keep such a copy
(unless ``--weight-prepack off``): +425 MB for SmolLM2, whose whole prefill step moved 1.06x (4 x 512 tokens) to
1.18x (one 128-token prompt), the reorder's share growing as the rows shrink.

Packed layers keep their dense weight too where the few-rows kernel beats the packed GEMM at some row counts
(``few_rows_vs_packed``, timed over a working set of the model's weights larger than the caches, as a step reads
them): in bfloat16 (pair products with AVX-512 BF16) on a Zen 5 host it took 1-11 rows, SmolLM2's 30 layers and LM
head at 1 row in 3.7 against 5.7 ms, 5 rows 4.4 against 6.6, and a batch-1 decode step from 11.9 to 9.4 ms, for
212 MB more memory (the dense copy; a tied LM head's is the embedding itself)."""
from __future__ import annotations

import ctypes
import functools
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine import native
from engine.models import row_calibration

log = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; 64 measured best across 1-512 rows (1 was 1.5-2x slower)
PACK_ROWS_HINT = 64
_PACKABLE = (torch.float32, torch.bfloat16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in _PACKABLE and _onednn_packs(dtype)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: asked by packing a small one, since its bfloat16
    path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and refuses at run time on an AVX2-only host."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_ROWS_HINT)
    except RuntimeError as e:
        log.info("oneDNN cannot pack %s weights on this CPU (%s): they stay dense", dtype, str(e).splitlines()[0])
        return False
    return True


def should_prepack(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """``--weight-prepack``: auto = bfloat16 only, on = whatever can be packed, off = nothing. (Float32 layers
    that are not packed still keep a packed copy for prefill unless it is off: ``use_few_rows_kernel``.)"""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--weight-prepack must be auto, on or off, not {mode!r}")
    return mode != "off" and can_prepack(device, dtype) and (mode == "on" or dtype == torch.bfloat16)


def _best(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` timed calls, after one untimed."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _linear_weights(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [mod.weight for mod in model.modules()
            if isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type == "cpu"]


def _widest(weights: list[torch.Tensor]) -> torch.Tensor:
    """The largest decoder-layer weight (an LM head, over 8,192 rows, only if there is nothing else)."""
    return max(weights, key=lambda w: (w.shape[0] <= 8192, w.shape[0] * w.shape[1]))


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's layout. Inputs are [rows, in_features]. ``few_rows``: the
    few-rows kernel and the row counts it beats the packed GEMM at; those rows read the dense weight, which is
    then kept too."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 few_rows: tuple[ctypes.CDLL, frozenset[int]] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()
        self._few_rows = few_rows if few_rows and few_rows[1] and weight.dtype in KERNEL_DTYPES else None
        self._dense = weight.detach().contiguous() if self._few_rows else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._few_rows is not None and x.dim() == 2 and x.shape[0] in self._few_rows[1]
                and x.dtype == self._dense.dtype):
            return few_rows_gemm(self._few_rows[0], x, self._dense, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def few_rows_operands(self) -> tuple[frozenset[int], torch.Tensor, torch.Tensor | None] | None:
        """The row counts ``forward`` gives the few-rows kernel, and the dense weight and bias it reads there
        (None when it gives it none): what a caller of the kernel itself needs to compute the same rows."""
        return None if self._few_rows is None else (self._few_rows[1], self._dense, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, tied_lm_head: torch.Tensor | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (the dense weight is dropped, unless the
    few-rows kernel beats the packed GEMM at some row counts: ``few_rows_vs_packed``). With tied embeddings,
    ``tied_lm_head`` (the embedding matrix) also gets a packed copy as ``model.lm_head``, since the embedding
    lookup still needs the dense one. Returns how many layers were packed."""
    weights = _linear_weights(model, torch.bfloat16) or _linear_weights(model)
    few_rows = few_rows_vs_packed(weights)
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(mod.weight.detach(), mod.bias, few_rows))
    if tied_lm_head is not None:
        model.lm_head = PackedLinear(tied_lm_head.detach(), None, few_rows)
        targets.append(("lm_head", model.lm_head))
    log.info("prepacked %d linear layers for the CPU GEMM", len(targets))
    return len(targets)


def few_rows_vs_packed(weights: list[torch.Tensor]) -> tuple[ctypes.CDLL, frozenset[int]] | None:
    """For float32 or bfloat16 weights about to be packed: the few-rows kernel and the row counts where it beats
    the packed GEMM on the widest of them (calibrate_rows against the packed layout, once per host), or None (no
    kernel, no such weight, one too small to time, or no count won)."""
    lib = few_rows_kernel()
    if lib is None or not weights or (widest := _widest(weights)).numel() < CALIBRATE_MIN:
        return None
    timed = working_set(weights)

    def measure() -> frozenset[int]:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT) for w in timed]
        return calibrate_rows(lib, timed, baseline=lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""), counts=calibrated_counts(lib, widest.dtype))
    bf16 = widest.dtype == torch.bfloat16
    rows = row_calibration.cached_rows(row_calibration.key(tuple(widest.shape), _kernel_key(lib, timed) + (
        "-bf16" if bf16 else "") + "-vs-packed"), measure)
    log.info("few-rows kernel for %s rows next to the packed GEMM (%s)", _ranges(rows) or "no",
             str(widest.dtype).replace("torch.", ""))
    return (lib, rows) if rows else None


# row counts timed at load: each one up to 32, then samples that stand for the counts since the one before, up to
# a batch-64 decode step. The kernel takes up to MAX_ROWS and beat MKL up to 200 rows on a Zen 5 host (1.5x), but
# oneDNN beat it from ~30 rows there (SmolLM2's 30 layers and LM head at 64 rows: 53.5 ms, the kernel 62.4, MKL
# 114.3) and takes the counts past 64, where prefill chunks start.
CALIBRATE_ROWS = (*range(1, 33), 40, 48, 56, 64)
MAX_ROWS = 256
CALIBRATE_MIN = 1 << 20  # weights with fewer elements are not timed
# their row counts: 1-3 rows stay on MKL's single-row path for them, as before calibration (with the kernel there
# too, the tiny model's PD logprobs differed from the colocated server's in the 4th decimal: not yet understood)
DEFAULT_ROWS = frozenset(range(4, 21))


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Bfloat16 inputs of at least this many rows, on a host where the kernel takes every count (no AVX-512 BF16),
# through MKL's float32 GEMM on widened copies of x and the weight where that was faster here (timed once per
# host at this count): the kernel's tiles reach ~47 GFLOP/s on an AVX2-only Zen 1 host (2 threads), MKL ~62 with
# the weight widened at every call (SmolLM2's 20 3,072 x 576 and 576 x 1,536 weights at 512 rows: 579 -> 457 ms;
# at 256 rows 1.09x, at 64 the kernel 1.56x). Prefill chunks, so a prompt row's result there depends on its chunk
# (as where oneDNN or MKL take prefill in float32); decode rows stay on the kernel.
WIDEN_ROWS = 512


@functools.cache
def few_rows_kernel() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("few_rows_gemm.c"))
    if lib is not None:
        for fn in (lib.splitserve_few_rows_gemm, lib.splitserve_few_rows_gemm_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        lib.splitserve_few_rows_bf16_max.restype = ctypes.c_int
    return lib


def max_rows(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """The most rows the kernel takes in ``dtype``: MAX_ROWS, but in bfloat16 with AVX-512 BF16 a few (pair
    products, no tiles: oneDNN's packed GEMM takes more)."""
    return lib.splitserve_few_rows_bf16_max() if dtype == torch.bfloat16 else MAX_ROWS


def calibrated_counts(lib: ctypes.CDLL, dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts a calibration times in ``dtype``: CALIBRATE_ROWS, or every count the kernel takes where
    that is a few."""
    top = max_rows(lib, dtype)
    return CALIBRATE_ROWS if top == MAX_ROWS else tuple(range(1, top + 1))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN's GEMM on a dense float32 weight (reordered per call) or a packed one."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


BIG_ROWS = 512  # a prefill chunk's rows, where MKL and oneDNN are compared


def onednn_beats_mkl(weight: torch.Tensor, reps: int = 3, passes: int = 3) -> bool:
    """Whether oneDNN's GEMM on the dense ``weight`` is faster than ``F.linear`` (MKL) at BIG_ROWS rows here:
    the median over ``passes`` of each one's best of ``reps``, once per host (``row_calibration``)."""
    if not can_prepack(weight.device, torch.float32):
        return False

    def measure() -> frozenset[int]:
        x = torch.randn(BIG_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
        try:
            with torch.inference_mode():
                saved = [_best(lambda: F.linear(x, weight), reps) - _best(lambda: onednn_linear(x, weight, None), reps)
                         for _ in range(passes)]
        except RuntimeError as e:  # a oneDNN build that packs but refuses this call: MKL it is
            log.info("oneDNN's float32 GEMM is not usable here (%s): MKL's takes prefill", str(e).splitlines()[0])
            return frozenset()
        return frozenset({BIG_ROWS}) if statistics.median(saved) > 0 else frozenset()
    return bool(row_calibration.cached_rows(row_calibration.key(tuple(weight.shape), "onednn-dense-vs-mkl"), measure))


def few_rows_gemm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 or bfloat16 CPU tensors (all of one dtype, weight contiguous) of
    at most ``max_rows`` rows, or of any number where the kernel takes MAX_ROWS (in pieces of that many: a row's
    result does not depend on the rows that come with it)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=weight.dtype)
    fn = lib.splitserve_few_rows_gemm_bf16 if weight.dtype == torch.bfloat16 else lib.splitserve_few_rows_gemm
    b = None if bias is None else bias.data_ptr()
    step = x.stride(0) * x.element_size(), y.stride(0) * y.element_size()
    for start in range(0, x.shape[0], MAX_ROWS):
        rows = min(MAX_ROWS, x.shape[0] - start)
        rc = fn(x.data_ptr() + start * step[0], weight.data_ptr(), b, y.data_ptr() + start * step[1], rows,
                weight.shape[0], weight.shape[1], torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"few-rows GEMM refused the shapes {tuple(x.shape)} x {tuple(weight.shape)}")
    return y


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bfloat16 operands in float32 (MKL), rounded to bfloat16."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(weight.dtype)


def widened_wins(lib: ctypes.CDLL, weight: torch.Tensor, reps: int = 2, passes: int = 3) -> frozenset[int]:
    """``{WIDEN_ROWS}`` where ``widened_linear`` beat the kernel (in pieces) at that many rows on ``weight`` (the
    median of ``passes``, each the best of ``reps``), else nothing: a row_calibration answer."""
    x = torch.randn(WIDEN_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        saved = [_best(lambda: few_rows_gemm(lib, x, weight, None), reps)
                 - _best(lambda: widened_linear(x, weight, None), reps) for _ in range(passes)]
    return frozenset({WIDEN_ROWS}) if statistics.median(saved) > 0 else frozenset()


class FewRowsLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state_dict) over a float32 CPU weight it shares rather than copies:
    ``rows`` (row counts) through the few-rows kernel, other inputs through ``F.linear``, or through oneDNN with
    ``onednn``: on a packed copy of the weight with ``packed`` (no reorder per call), else on the dense weight.
    ``beyond``: counts above all of ``rows`` go to the kernel too (bfloat16 where no CPU GEMM takes it fast), but
    ``widen`` counts of at least WIDEN_ROWS to ``widened_linear``. ``tied``: the weight belongs to another module
    (the embeddings), so it is held outside this module's state_dict."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL, tied: bool = False,
                 rows: frozenset[int] = DEFAULT_ROWS, onednn: bool = False, packed: bool = False,
                 beyond: bool = False, widen: bool = False) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a new weight
        self.out_features, self.in_features = weight.shape
        if tied:
            self.register_buffer("weight", weight.detach(), persistent=False)
        else:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._lib = lib
        self.rows = rows
        self.beyond = max(rows) if beyond and rows else None  # counts above this one: the kernel
        self.widen = widen
        self.onednn = onednn
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
                        if onednn and packed else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[1] == self.in_features and x.dtype == self.weight.dtype
                and self.weight.is_contiguous()):
            if self.widen and x.shape[0] >= WIDEN_ROWS:
                return widened_linear(x, self.weight, self.bias)
            if x.shape[0] in self.rows or self.beyond is not None and x.shape[0] > self.beyond:
                return few_rows_gemm(self._lib, x, self.weight, self.bias)
            if self.onednn:
                return onednn_linear(x, self.weight if self.packed is None else self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def few_rows_operands(self) -> tuple[frozenset[int], torch.Tensor, torch.Tensor | None] | None:
        """As ``PackedLinear.few_rows_operands``."""
        return (self.rows, self.weight, self.bias) if self.rows and self.weight.is_contiguous() else None


def use_few_rows_kernel(model: nn.Module, tied_lm_head: torch.Tensor | None = None, packed: bool = True,
                        dtype: torch.dtype = torch.float32) -> int:
    """Route ``model``'s ``dtype`` CPU ``nn.Linear`` layers (and a tied LM head, as ``model.lm_head`` sharing the
    embedding matrix) through ``FewRowsLinear`` when the kernel compiles; returns how many layers were. Bfloat16
    layers come here where oneDNN does not pack them (a host without AVX-512, or ``--weight-prepack off``): the
    kernel takes up to ``max_rows`` rows where it beats ``F.linear``, which takes the rest; or, in bfloat16 where
    it takes MAX_ROWS (no AVX-512 BF16) and beat ``F.linear`` at the most rows timed, every count above those
    too (prefill chunks in pieces of MAX_ROWS), but from WIDEN_ROWS MKL on widened operands where that timed
    faster (``widened_wins``). On an AVX2-only Zen 1 host (2 threads) F.linear's bfloat16 ran
    SmolLM2's 3072 x 576 layer at 10 GFLOP/s for 16-512 rows, the kernel at 47 (MKL's float32: 62 at 512 rows).
    ``packed``: where oneDNN takes the row counts the kernel does not (prefill), the decoder layers keep a copy
    of their weight in its layout. SmolLM2 on a Zen 5 host, 2 threads: a 128-token prompt's step 84 -> 76 ms,
    a 4 x 512-token step 1.15 -> 1.10 s (oneDNN reordered the whole weight at every call), for +425 MB; the LM
    head (prefill computes a few rows of it) stays dense."""
    lib = few_rows_kernel()
    if lib is None:
        return 0
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type == "cpu"]
    if dtype not in KERNEL_DTYPES or not targets:
        return 0
    widest = _widest([mod.weight for _, mod in targets])
    # weights this small take microseconds, which timing cannot tell apart: they keep a fixed default and MKL
    big = dtype == torch.float32 and widest.numel() >= CALIBRATE_MIN and onednn_beats_mkl(widest)
    counts = calibrated_counts(lib, dtype)
    # timed once per host (row_calibration: every process on it must choose alike), on this weight's shape. Against
    # MKL even where oneDNN takes the other counts: oneDNN beat the kernel from ~30 rows on a Zen 5 host, but its
    # result for a row depends on how many rows came with it (its blocking follows the row count), and the
    # kernel's does not, so a decoding request's tokens do not depend on its batch (retraction, speculation). On
    # one weight, which stays in the cache: against MKL the kernel won every count to 64 that way on a Zen 5 host
    # and over a working set alike (working_set), which took 3.3 s against 0.4 at a host's first load
    stem = Path(lib._name).stem + ("" if dtype == torch.float32 else "-bf16")
    rows = (row_calibration.cached_rows(row_calibration.key(tuple(widest.shape), stem),
                                        lambda: calibrate_rows(lib, [widest], counts=counts))
            if (timed := widest.numel() >= CALIBRATE_MIN) else DEFAULT_ROWS & set(counts))
    log.info("few-rows kernel for %s rows (%s on a %d x %d weight), %s for the others", _ranges(rows) or "no",
             "timed on this host" if timed else "the default: too small to time",
             widest.shape[0], widest.shape[1], "oneDNN" if big else "F.linear (MKL)")
    if not rows and not big:
        return 0
    beyond = dtype == torch.bfloat16 and max_rows(lib, dtype) == MAX_ROWS and max(counts) in rows
    widen = False
    if beyond:
        widen = bool(row_calibration.cached_rows(row_calibration.key(tuple(widest.shape), stem + "-widen"),
                                                 lambda: widened_wins(lib, widest)))
        log.info("few-rows kernel for bfloat16 above %d rows too (F.linear was slower at %d)%s", max(rows),
                 max(rows), f", from {WIDEN_ROWS} rows MKL on widened operands" if widen else "")
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FewRowsLinear(mod.weight, mod.bias, lib, rows=rows, onednn=big, packed=packed,
                                             beyond=beyond, widen=widen))
    if tied_lm_head is not None and tied_lm_head.dtype == dtype and tied_lm_head.device.type == "cpu":
        model.lm_head = FewRowsLinear(tied_lm_head, None, lib, tied=True, rows=rows, onednn=big, beyond=beyond,
                                      widen=widen)
        targets.append(("lm_head", model.lm_head))
    return len(targets)


def calibrate_rows(lib: ctypes.CDLL, weights: list[torch.Tensor], reps: int = 3, passes: int = 3,
                   baseline: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                   counts: tuple[int, ...] = CALIBRATE_ROWS) -> frozenset[int]:
    """The row counts in ``counts`` where the kernel beats ``baseline`` (``F.linear``; called with the input and
    the weight's index) over ``weights`` (``working_set``: each count's time is all of them in turn) here.
    ``passes`` sweeps over the counts, each timing both ``reps`` times (best of each); a count's saving is its
    median over the passes, so a disturbance during one sweep (another worker loading its model on the same
    cores) does not decide; then the one contiguous range of counts that saves the most time in all
    (``best_range``, a sampled count weighted by the counts it stands for, and standing for all of them in the
    result), so one noisy count cannot punch a hole in the range or add a stray one. About a second, once per
    host (``row_calibration``)."""

    base = baseline or (lambda x, i: F.linear(x, weights[i]))
    g = torch.Generator().manual_seed(0)
    widths = sorted({w.shape[1] for w in weights})
    inputs = {m: {k: torch.randn(m, k, generator=g).to(weights[0].dtype) for k in widths} for m in counts}
    saved: dict[int, list[float]] = {m: [] for m in counts}

    def run(fn: Callable[[torch.Tensor, int], torch.Tensor], xs: dict[int, torch.Tensor]) -> Callable[[], None]:
        def every_weight() -> None:
            for i, w in enumerate(weights):
                fn(xs[w.shape[1]], i)
        return every_weight
    with torch.inference_mode():
        for _ in range(passes):
            for m, xs in inputs.items():
                saved[m].append(_best(run(base, xs), reps)
                                - _best(run(lambda x, i: few_rows_gemm(lib, x, weights[i], None), xs), reps))
    return best_range({m: statistics.median(v) for m, v in saved.items()})


LLC_DEFAULT = 32 << 20  # bytes of last-level cache assumed where the OS does not say


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


def _kernel_key(lib: ctypes.CDLL, timed: list[torch.Tensor]) -> str:
    """The kernel's part of a calibration key: the compiled library and the working set's size."""
    return f"{Path(lib._name).stem}-{sum(w.numel() * w.element_size() for w in timed) >> 20}MB"


def _stands_for(counts: list[int]) -> dict[int, range]:
    """Each sampled row count and the counts it stands for: those after the sample before it, up to itself."""
    return {m: range(prev + 1, m + 1) for prev, m in zip([0, *counts], counts)}


def best_range(saved: dict[int, float]) -> frozenset[int]:
    """The contiguous run of keys (in order) with the largest positive sum of ``saved`` (Kadane), or none; a key
    counts for the row counts it stands for (``_stands_for``), and the result holds all of them."""
    spans = _stands_for(sorted(saved))
    best, best_sum, run, run_sum = frozenset(), 0.0, [], 0.0
    for m in sorted(saved):
        if run_sum <= 0:
            run, run_sum = [], 0.0
        run.append(m)
        run_sum += saved[m] * len(spans[m])
        if run_sum > best_sum:
            best, best_sum = frozenset(c for k in run for c in spans[k]), run_sum
    return best


def _ranges(rows: frozenset[int]) -> str:
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
