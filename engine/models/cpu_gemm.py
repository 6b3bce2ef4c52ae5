"""The GEMM routes a CPU linear layer can take, as plain functions: the few-rows kernel (few_rows_gemm.c),
oneDNN's GEMM on a dense or packed weight, and MKL's float32 GEMM on widened bfloat16 operands. Which route a
layer takes for a row count is decided in linear.py, from timings made at load (gemm_timing.py).

The few-rows kernel reads each weight row once for all of a call's rows, where MKL's sgemm packs the whole weight
per call: for a small decode batch or a speculative verification that packing is most of the work. A row's result
does not depend on the rows that come with it, so a decoding request's tokens do not depend on its batch. In
bfloat16 with AVX-512 BF16 it takes a few rows (pair products, no tiles); elsewhere its float32 tiles take bfloat16
weights at every count (MAX_ROWS a call, larger inputs in pieces). With AVX-512, or AVX2 and FMA, the same library's
output-lanes GEMM (lanes_gemm.h, which few_rows_gemm.c includes) takes weights repacked once (``lanes_pack``;
bfloat16 in pairs, with AVX-512 BF16) at up to MAX_ROWS rows: what packed layers use for the row counts it beats
oneDNN's GEMM at."""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import native
from engine.mem import huge_pages

log = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; 64 measured best across 1-512 rows (1 was 1.5-2x slower)
PACK_ROWS_HINT = 64
_PACKABLE = (torch.float32, torch.bfloat16)
MAX_ROWS = 256  # the most rows one kernel call takes (float32 tiles)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Bfloat16 inputs of at least this many rows, on a host where the kernel takes every count (no AVX-512 BF16),
# through MKL's float32 GEMM on widened copies of x and the weight where that was faster here (timed once per
# host at this count): the kernel's tiles reach ~47 GFLOP/s on an AVX2-only Zen 1 host (2 threads), MKL ~62 with
# the weight widened at every call. There, three of each of a model's four layer shapes in turn, alternating (ad
# hoc), widened over the kernel: SmolLM2 128 rows 0.93x, 192 1.02x, 256 1.20x, 512 1.26x; the 150M model 0.85x,
# 1.08x, 1.14x, 1.23x. Prefill chunks, so a prompt row's result there depends on its chunk (as where oneDNN or MKL
# take prefill in float32); steps of fewer rows (decode batches and verifications under 256 rows) stay on the
# kernel, whose result for a row does not depend on its batch.
WIDEN_ROWS = 256


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


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout, for ``onednn_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN's GEMM on a dense float32 weight (reordered per call) or a packed one."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def few_rows_kernel() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("few_rows_gemm.c"))
    if lib is not None:
        for fn in (lib.splitserve_few_rows_gemm, lib.splitserve_few_rows_gemm_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        lib.splitserve_few_rows_bf16_max.restype = ctypes.c_int
        lib.splitserve_pair_gemm_bf16.restype = ctypes.c_int
        lib.splitserve_pair_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        lib.splitserve_pair_rows_max.restype = ctypes.c_int
        lib.splitserve_lanes_gemm.restype = ctypes.c_int
        lib.splitserve_lanes_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        lib.splitserve_lanes_rows_max.restype = ctypes.c_int
    return lib


def max_rows(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """The most rows the kernel takes in ``dtype``: MAX_ROWS, but in bfloat16 with AVX-512 BF16 a few (pair
    products, no tiles: oneDNN's packed GEMM takes more)."""
    return lib.splitserve_few_rows_bf16_max() if dtype == torch.bfloat16 else MAX_ROWS


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


def lanes_rows_max(lib: ctypes.CDLL, dtype: torch.dtype) -> int:
    """The most rows the output-lanes GEMM takes in ``dtype``: the pair GEMM in bfloat16 (AVX-512 BF16, or AVX2),
    the lanes GEMM in float32 (AVX-512, or AVX2 with FMA); 0 where it has none (another CPU, or an older kernel
    library)."""
    name = "splitserve_pair_rows_max" if dtype == torch.bfloat16 else "splitserve_lanes_rows_max"
    return getattr(lib, name)() if dtype in KERNEL_DTYPES and hasattr(lib, name) else 0


def lanes_pack(weight: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """``weight`` [n, k] in the output-lanes GEMM's layout: blocks of 16 output rows (zeros past n), back to back,
    each [k / 2][16][2] in bfloat16 (k even: pairs of k, VDPBF16PS's operand) or [k][16] in float32; flat,
    ceil(n / 16) * 16 * k elements. ``consume``: the caller hands the weight over, so where the layout takes as
    many bytes (n a multiple of 16) it is written over the weight's own memory (a loaded model's weights are in
    huge pages: mem/huge_pages.py); new memory is asked huge pages too."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16
    assert weight.dtype in KERNEL_DTYPES and (k % 2 == 0 or not pairs), (weight.dtype, k)
    blocks = -(-n // 16)
    padded = F.pad(weight.detach(), (0, 0, 0, blocks * 16 - n))
    packed = (padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3) if pairs
              else padded.view(blocks, 16, k).permute(0, 2, 1)).contiguous().view(-1)
    if consume and weight.is_contiguous() and packed.numel() == weight.numel():
        out = weight.detach().view(-1)
    else:
        out = torch.empty_like(packed)
        huge_pages.advise(out)
    return out.copy_(packed)


def lanes_gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for CPU rows ``x`` of ``packed`` = ``lanes_pack(weight)``'s dtype, ``weight``
    having ``n`` rows; in pieces of the kernel's most rows (``lanes_rows_max``: MAX_ROWS)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=packed.dtype)
    fn = lib.splitserve_pair_gemm_bf16 if packed.dtype == torch.bfloat16 else lib.splitserve_lanes_gemm
    step = x.shape[1] * x.element_size(), n * y.element_size()
    for start in range(0, x.shape[0], MAX_ROWS):
        rows = min(MAX_ROWS, x.shape[0] - start)
        rc = fn(x.data_ptr() + start * step[0], packed.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr() + start * step[1], rows, n, x.shape[1], torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"output-lanes GEMM refused the shapes {tuple(x.shape)} x ({n}, {x.shape[1]})")
    return y


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bfloat16 operands in float32 (MKL), rounded to bfloat16."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(weight.dtype)
