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
real-model test allows. So by default (``auto``) only bfloat16 weights were packed; ``on`` packs float32 too.
Now ``auto`` packs a float32 model as well where the output-lanes GEMM runs (AVX-512, or AVX2 with FMA) and takes
its decode-sized steps (``packs_float32_for_lanes``): its logits stay within 1e-4 of transformers, prefill chunks of
more than 256 rows going to the packed GEMM as ``FewRowsLinear`` sent them to oneDNN. Only CPU weights are packed.
Where oneDNN packs no bfloat16 (AVX2) a bfloat16 model's layers take the lanes GEMM at every count, without a oneDNN
copy, where it beat ``FewRowsLinear``'s route at every count timed (``lanes_without_onednn``).

Float32 weights that are not packed go through ``FewRowsLinear``: for few rows (a small decode batch, a
speculative verification) the few-rows kernel (cpu_gemm.py) reads each weight row once, where MKL's sgemm packs
the whole weight per call. So do bfloat16 weights oneDNN does not pack (a CPU without AVX-512, or
``--weight-prepack off``), for up to the kernel's bfloat16 row limit (11 with AVX-512 BF16; elsewhere, where
torch has no fast bfloat16 GEMM at all, the float32 tiles take bfloat16 weights at every count). Which row
counts it takes is measured when the model loads, once per host (gemm_timing.py: counts from 1 to 64 on one of
the model's own layer shapes, the kernel against ``F.linear``).

The row counts the kernel does not take (prefill chunks, large decode batches) go to oneDNN's GEMM where it beats
MKL's behind ``F.linear`` here (``gemm_timing.onednn_beats_mkl``, timed at a prefill chunk's rows once per host).
On a Zen 5 host (2 cores) it ran SmolLM2's 3072 x 576 layer at 1,024 rows in 8.4 ms against MKL's 18.7 (429
against 194 GFLOP/s) on the dense weight, which it reorders per call, and in 7.4 ms on a packed copy. The decoder
layers keep such a copy (unless ``--weight-prepack off``): +425 MB for SmolLM2, whose whole prefill step moved
1.06x (4 x 512 tokens) to 1.18x (one 128-token prompt), the reorder's share growing as the rows shrink.

Packed layers keep a second copy of their weight where a few-rows kernel beats the packed GEMM at some row counts
(``few_rows_vs_packed``, timed over a working set of the model's weights larger than the caches, as a step reads
them). In float32 (``--weight-prepack on``) that is the dense weight for the few-rows kernel. In bfloat16 with
AVX-512 BF16 it was the dense weight too, for the kernel's row-by-row pair products (1-11 rows on a Zen 5 host:
SmolLM2's 30 layers and LM head at 1 row 3.7 against 5.7 ms, a batch-1 decode step 11.9 -> 9.4 ms); now it is a
copy in the pair GEMM's layout (cpu_gemm.lanes_pack: 16 outputs' weights for two k in each vector, so a step is one
broadcast x pair and one VDPBF16PS per 16 outputs, 8 x rows by 48 outputs in registers), written over the dense
weight's own memory, so no more memory than before (but for a tied LM head: +56 MB for SmolLM2, the embedding
staying dense for the lookup). Float32 layers packed by ``auto`` do the same with one k a step (the lanes GEMM).
Over SmolLM2's 30 layers' shapes on a Zen 4 host (2 threads, alternating), pair GEMM / row-by-row kernel / packed
GEMM: 1 row 7.6 / 8.2 / 12.6 ms, 4 rows 8.5 / 10.8 / 12.7, 11 rows 11.6 / 14.4 / 14.1, 32 rows 19.9 / - / 24.3, 64
rows 36.8 / - / 41.2 (369 against 330 GFLOP/s), 128 rows 69.2 / - / 73.9; the calibration there took it for 1-256
rows (the most it times), in float32 too (docs/benchmarks.md, "The output-lanes GEMM"). Where it took 256 and, in
pieces of 256, kept level with the packed GEMM at 512 rows as well (``gemm_timing.lanes_beyond``; 1.00-1.03x there
at 512 and 2,048 rows in both dtypes), it takes every count and the packed copy is dropped: every step can then run
in the native layer stack, and SmolLM2's PSS after load is 205 MB (bfloat16) and 548 MB (float32) less."""
from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import cpu_gemm, gemm_timing, row_calibration
from engine.models.cpu_gemm import KERNEL_DTYPES, MAX_ROWS, WIDEN_ROWS
from engine.models.gemm_timing import CALIBRATE_MIN, DEFAULT_ROWS

log = logging.getLogger(__name__)


def should_prepack(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """``--weight-prepack``: auto = bfloat16 only, on = whatever can be packed, off = nothing. (Float32 layers
    that are not packed still keep a packed copy for prefill unless it is off: ``use_few_rows_kernel``.)"""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--weight-prepack must be auto, on or off, not {mode!r}")
    return mode != "off" and cpu_gemm.can_prepack(device, dtype) and (mode == "on" or dtype == torch.bfloat16)


def packs_float32_for_lanes(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``auto`` packs a float32 model too: where the output-lanes GEMM runs here (AVX-512 or AVX2 with
    FMA), the model's decoder layers have a weight large enough to time (SmolLM2's 3,072 x 576; not the tiny test
    model's, whose mechanics tests keep ``FewRowsLinear``) and oneDNN or the lanes GEMM beat MKL at a prefill
    chunk's rows, its layers become ``PackedLinear``: the lanes GEMM takes the row counts it won (on a copy that
    takes the dense weight's memory), oneDNN's packed GEMM the rest, as ``FewRowsLinear`` gave them to oneDNN
    before. Where only the lanes GEMM beat MKL, it beat the packed GEMM at those rows too or the packed GEMM beat
    it (``few_rows_vs_packed``, ``lanes_beyond``): either way prefill chunks take no slower a GEMM than MKL's."""
    lib = cpu_gemm.few_rows_kernel()
    layers = getattr(model, "layers", None)
    weights = _linear_weights(layers) if isinstance(layers, nn.Module) else []
    return (mode == "auto" and dtype == torch.float32 and lib is not None and bool(weights)
            and cpu_gemm.lanes_rows_max(lib, dtype) > 0 and cpu_gemm.can_prepack(device, dtype)
            and (widest := _widest(weights)).numel() >= CALIBRATE_MIN
            and (gemm_timing.onednn_beats_mkl(widest) or gemm_timing.lanes_beats_mkl(lib, widest)))


def lanes_without_onednn(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype) -> RowRoute | None:
    """Where oneDNN does not pack ``dtype`` here (bfloat16 without AVX-512) but the output-lanes GEMM takes it
    (AVX2: bfloat16 pairs widened as they are read), ``auto``'s route for the model's layers if that GEMM beat
    ``FewRowsLinear``'s at every count timed (1-256 rows, the few-rows kernel, over a working set of the model's
    weights) and kept level at a prefill chunk's rows (against MKL on widened operands where that beat the kernel
    here): every count, in ``PackedLinear`` without a oneDNN copy (``auto`` and ``on``). None: ``FewRowsLinear``
    keeps them."""
    lib = cpu_gemm.few_rows_kernel()
    layers = getattr(model, "layers", None)
    weights = _linear_weights(layers, dtype) if isinstance(layers, nn.Module) else []
    if (mode == "off" or device.type != "cpu" or lib is None or not weights or cpu_gemm.can_prepack(device, dtype)
            or cpu_gemm.lanes_rows_max(lib, dtype) == 0 or (widest := _widest(weights)).numel() < CALIBRATE_MIN):
        return None
    if any(_odd_pairs(True, w) for w in _linear_weights(model, dtype)):  # PackedLinear would need oneDNN for them
        return None
    timed = gemm_timing.working_set(weights)
    lanes = _lanes_on(lib, timed)
    stem = gemm_timing.kernel_key(lib, timed) + f"-lanes-vs-kernel-{str(dtype).replace('torch.', '')}"
    kernel = lambda x, i: cpu_gemm.few_rows_gemm(lib, x, timed[i], None)  # noqa: E731
    rows = row_calibration.cached_rows(row_calibration.key(tuple(widest.shape), stem),
                                       lambda: gemm_timing.calibrate_rows(lib, timed, counts=LANES_COUNTS,
                                                                          kernel=lanes, baseline=kernel))
    beyond = _lanes_beyond(widest, stem, rows, lambda: gemm_timing.lanes_beyond(
        timed, lanes, (lambda x, i: cpu_gemm.widened_linear(x, timed[i], None))
        if _widened_wins(lib, widest) else kernel))
    log.info("output-lanes GEMM against the few-rows kernel (%s): %s rows%s", str(dtype).replace("torch.", ""),
             gemm_timing.ranges(rows) or "no", ", and level at 512: it takes every count" if beyond else
             " (not every count: the kernel keeps them)")
    return RowRoute(lib, rows, lanes=True, beyond=True) if beyond else None


LANES_COUNTS = gemm_timing.LANES_CALIBRATE_ROWS


def _lanes_on(lib: ctypes.CDLL, timed: list[torch.Tensor]) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The output-lanes GEMM over ``timed`` as calibrations call it (rows, weight index), packing its copies of
    them on its first call."""
    copies: list[torch.Tensor] = []

    def lanes(x: torch.Tensor, i: int) -> torch.Tensor:
        if not copies:
            copies.extend(cpu_gemm.lanes_pack(w) for w in timed)
        return cpu_gemm.lanes_gemm(lib, x, copies[i], timed[i].shape[0], None)
    return lanes


def _lanes_beyond(widest: torch.Tensor, stem: str, rows: frozenset[int],
                  measure: Callable[[], frozenset[int]]) -> bool:
    """Whether the output-lanes GEMM, having won every count timed (``rows``), also kept level at BIG_ROWS rows
    (``measure``: gemm_timing.lanes_beyond against the route's own GEMM there; once per host)."""
    return max(LANES_COUNTS) in rows and bool(row_calibration.cached_rows(
        row_calibration.key(tuple(widest.shape), stem + f"-beyond{gemm_timing.BIG_ROWS}"), measure))


def _widened_wins(lib: ctypes.CDLL, widest: torch.Tensor) -> bool:
    """Whether MKL on widened bfloat16 operands beat the few-rows kernel at WIDEN_ROWS rows here (once per host)."""
    stem = Path(lib._name).stem + "-bf16"
    return bool(row_calibration.cached_rows(row_calibration.key(tuple(widest.shape), stem + f"-widen{WIDEN_ROWS}"),
                                            lambda: gemm_timing.widened_wins(lib, widest)))


def _linear_weights(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [mod.weight for mod in model.modules()
            if isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type == "cpu"]


def _widest(weights: list[torch.Tensor]) -> torch.Tensor:
    """The largest decoder-layer weight (an LM head, over 8,192 rows, only if there is nothing else)."""
    return max(weights, key=lambda w: (w.shape[0] <= 8192, w.shape[0] * w.shape[1]))


class FewRowsOperands(NamedTuple):
    """What a caller of the few-rows kernels itself (the native layer stack) needs to compute a layer's rows as
    its ``forward`` does: the C function (``kernel``, a name in cpu_gemm.few_rows_kernel's library) and the row
    counts it takes, the weight in that function's layout and the bias."""
    kernel: str
    rows: frozenset[int]
    weight: torch.Tensor
    bias: torch.Tensor | None
    beyond: bool = False  # every count above ``rows`` too (in pieces of MAX_ROWS)


@dataclasses.dataclass(frozen=True)
class RowRoute:
    """The row counts a packed layer gives a few-rows kernel instead of the packed GEMM: the dense-weight kernel,
    or, with ``lanes``, the output-lanes GEMM on a copy in its own layout (cpu_gemm.lanes_pack); with ``beyond``
    (lanes only) every count above ``rows`` too, so no packed copy is kept."""
    lib: ctypes.CDLL
    rows: frozenset[int]
    lanes: bool
    beyond: bool = False


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in oneDNN's layout. Inputs are [rows, in_features]. ``route``: the row
    counts a few-rows kernel beats the packed GEMM at; those rows read a second copy of the weight (dense, or in
    the output-lanes GEMM's layout), which is then kept too."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: RowRoute | None = None,
                 consume: bool = False) -> None:
        """``consume``: the caller hands ``weight`` over (no one else reads it): a lanes copy may take its memory."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._route = route if route and route.rows and weight.dtype in KERNEL_DTYPES else None
        everywhere = self._route is not None and self._route.lanes and self._route.beyond
        self.packed = None if everywhere else cpu_gemm.pack(weight)  # None: the lanes GEMM takes every count
        self.bias = None if bias is None else bias.detach().contiguous()
        self._copy = (None if self._route is None else cpu_gemm.lanes_pack(weight, consume) if self._route.lanes
                      else weight.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self._route
        if self.packed is None:  # every input, as rows of the weight's dtype
            assert route is not None and self._copy is not None
            rows = x.reshape(-1, self.in_features).to(self._copy.dtype)
            y = cpu_gemm.lanes_gemm(route.lib, rows, self._copy, self.out_features, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if route is not None and x.dim() == 2 and x.shape[0] in route.rows and x.dtype == self.packed.dtype:
            if route.lanes:
                return cpu_gemm.lanes_gemm(route.lib, x, self._copy, self.out_features, self.bias)
            return cpu_gemm.few_rows_gemm(route.lib, x, self._copy, self.bias)
        return cpu_gemm.onednn_linear(x, self.packed, self.bias)

    def few_rows_operands(self) -> FewRowsOperands | None:
        """The row counts ``forward`` gives a few-rows kernel and what it reads there (None when it gives it
        none)."""
        route = self._route
        if route is None:
            return None
        bf16 = self._copy.dtype == torch.bfloat16
        name = (("splitserve_pair_gemm_bf16" if bf16 else "splitserve_lanes_gemm") if route.lanes
                else "splitserve_few_rows_gemm_bf16" if bf16 else "splitserve_few_rows_gemm")
        return FewRowsOperands(name, route.rows, self._copy, self.bias, self.packed is None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, tied_lm_head: torch.Tensor | None = None, route: RowRoute | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (the dense weight is dropped, unless a
    few-rows kernel beats the packed GEMM at some row counts: ``few_rows_vs_packed``, or ``route`` says so). With
    tied embeddings, ``tied_lm_head`` (the embedding matrix) also gets a packed copy as ``model.lm_head``, since the
    embedding lookup still needs the dense one. Returns how many layers were packed."""
    if route is None:
        route = few_rows_vs_packed(_linear_weights(model, torch.bfloat16) or _linear_weights(model))
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(mod.weight.detach(), mod.bias, _fits(route, mod.weight), consume=True))
    if tied_lm_head is not None:
        model.lm_head = PackedLinear(tied_lm_head.detach(), None, _fits(route, tied_lm_head))
        targets.append(("lm_head", model.lm_head))
    log.info("prepacked %d linear layers for the CPU GEMM", len(targets))
    return len(targets)


def _fits(route: RowRoute | None, weight: torch.Tensor) -> RowRoute | None:
    """``route`` where its kernel takes ``weight``'s shape (bfloat16 pairs: an even in_features)."""
    return None if route is None or _odd_pairs(route.lanes, weight) else route


def _odd_pairs(lanes: bool, weight: torch.Tensor) -> bool:
    """Whether the output-lanes GEMM cannot take ``weight``: bfloat16 (pairs of k) with an odd in_features."""
    return lanes and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 1


def few_rows_vs_packed(weights: list[torch.Tensor]) -> RowRoute | None:
    """For float32 or bfloat16 weights about to be packed: the few-rows kernel (the output-lanes GEMM, where this
    CPU has it) and the row counts where it beats the packed GEMM over a working set of them
    (calibrate_rows against the packed layout, once per host), or None (no kernel, no such weight, one too small
    to time, or no count won)."""
    lib = cpu_gemm.few_rows_kernel()
    if lib is None or not weights or (widest := _widest(weights)).numel() < CALIBRATE_MIN:
        return None
    lanes = cpu_gemm.lanes_rows_max(lib, widest.dtype) > 0
    timed = gemm_timing.working_set([w for w in weights if not _odd_pairs(lanes, w)])
    if not timed:
        return None
    counts = LANES_COUNTS if lanes else gemm_timing.calibrated_counts(lib, widest.dtype)
    kernel = _lanes_on(lib, timed) if lanes else None
    packed: list[torch.Tensor] = []

    def onednn(x: torch.Tensor, i: int) -> torch.Tensor:
        """The packed GEMM over the timed weights, packing them on its first call."""
        if not packed:
            packed.extend(cpu_gemm.pack(w) for w in timed)
        return cpu_gemm.onednn_linear(x, packed[i], None)
    bf16 = widest.dtype == torch.bfloat16
    stem = gemm_timing.kernel_key(lib, timed) + ("-lanes" if lanes else "") + ("-bf16" if bf16 else "")
    rows = row_calibration.cached_rows(
        row_calibration.key(tuple(widest.shape), stem + "-vs-packed"),
        lambda: gemm_timing.calibrate_rows(lib, timed, counts=counts, kernel=kernel, baseline=onednn))
    beyond = kernel is not None and _lanes_beyond(widest, stem, rows,
                                                  lambda: gemm_timing.lanes_beyond(timed, kernel, onednn))
    log.info("%s for %s rows next to the packed GEMM (%s)%s", "output-lanes GEMM" if lanes else "few-rows kernel",
             gemm_timing.ranges(rows) or "no", str(widest.dtype).replace("torch.", ""),
             f", and above: level with it at {gemm_timing.BIG_ROWS} rows (no packed copy kept)" if beyond else "")
    return RowRoute(lib, rows, lanes, beyond) if rows else None


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
        self.packed = cpu_gemm.pack(weight) if onednn and packed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[1] == self.in_features and x.dtype == self.weight.dtype
                and self.weight.is_contiguous()):
            if self.widen and x.shape[0] >= WIDEN_ROWS:
                return cpu_gemm.widened_linear(x, self.weight, self.bias)
            if x.shape[0] in self.rows or self.beyond is not None and x.shape[0] > self.beyond:
                return cpu_gemm.few_rows_gemm(self._lib, x, self.weight, self.bias)
            if self.onednn:
                return cpu_gemm.onednn_linear(x, self.weight if self.packed is None else self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def few_rows_operands(self) -> FewRowsOperands | None:
        """As ``PackedLinear.few_rows_operands``."""
        name = "splitserve_few_rows_gemm_bf16" if self.weight.dtype == torch.bfloat16 else "splitserve_few_rows_gemm"
        return (FewRowsOperands(name, self.rows, self.weight, self.bias)
                if self.rows and self.weight.is_contiguous() else None)


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
    lib = cpu_gemm.few_rows_kernel()
    if lib is None:
        return 0
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type == "cpu"]
    if dtype not in KERNEL_DTYPES or not targets:
        return 0
    widest = _widest([mod.weight for _, mod in targets])
    # weights this small take microseconds, which timing cannot tell apart: they keep a fixed default and MKL
    big = dtype == torch.float32 and widest.numel() >= CALIBRATE_MIN and gemm_timing.onednn_beats_mkl(widest)
    counts = gemm_timing.calibrated_counts(lib, dtype)
    # timed once per host (row_calibration: every process on it must choose alike), on this weight's shape. Against
    # MKL even where oneDNN takes the other counts: oneDNN beat the kernel from ~30 rows on a Zen 5 host, but its
    # result for a row depends on how many rows came with it (its blocking follows the row count), and the
    # kernel's does not, so a decoding request's tokens do not depend on its batch (retraction, speculation). On
    # one weight, which stays in the cache: against MKL the kernel won every count to 64 that way on a Zen 5 host
    # and over a working set alike (working_set), which took 3.3 s against 0.4 at a host's first load
    stem = Path(lib._name).stem + ("" if dtype == torch.float32 else "-bf16")
    rows = (row_calibration.cached_rows(row_calibration.key(tuple(widest.shape), stem),
                                        lambda: gemm_timing.calibrate_rows(lib, [widest], counts=counts))
            if (timed := widest.numel() >= CALIBRATE_MIN) else DEFAULT_ROWS & set(counts))
    log.info("few-rows kernel for %s rows (%s on a %d x %d weight), %s for the others",
             gemm_timing.ranges(rows) or "no", "timed on this host" if timed else "the default: too small to time",
             widest.shape[0], widest.shape[1], "oneDNN" if big else "F.linear (MKL)")
    if not rows and not big:
        return 0
    beyond = dtype == torch.bfloat16 and cpu_gemm.max_rows(lib, dtype) == MAX_ROWS and max(counts) in rows
    widen = False
    if beyond:
        widen = _widened_wins(lib, widest)
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
