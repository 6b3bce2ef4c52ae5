"""The paged KV pool: for every layer one K and one V buffer laid out [num_pages * page_size, kv_heads,
head_dim], all in one allocation [layers, 2, slots, kv_heads, head_dim]. Page p of layer l's K starts at
``k_base(l) + p * page_bytes``; a page is contiguous, so contiguous page runs are contiguous memory."""
from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass

import torch

from engine.mem.huge_pages import libc

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without changing their contents
# Prefaulting goes in pieces sized to take about PREFAULT_PIECE_S each (what a request arriving meanwhile waits):
# the rate varies tenfold. On a 2-core AMD EPYC VM, 8 MiB took 2.4 ms in memory a process had just freed and
# 20-50 ms in memory the VM had not touched yet, so fixed 8 MiB pieces held each request sent in a fresh server's
# first ~20 s (a 3.6 GiB pool) for up to ~100 ms.
PREFAULT_PIECE_S = 0.004
PREFAULT_MIN_BYTES, PREFAULT_FIRST_BYTES, PREFAULT_MAX_BYTES = 256 << 10, 1 << 20, 64 << 20


def prefault_piece_bytes(last_bytes: int, last_seconds: float, budget_s: float = PREFAULT_PIECE_S) -> int:
    """The next piece's size: the last piece's rate times the budget, within [PREFAULT_MIN_BYTES,
    PREFAULT_MAX_BYTES], in whole 4 KiB pages."""
    rate = last_bytes / max(last_seconds, 1e-6)
    return int(min(max(rate * budget_s, PREFAULT_MIN_BYTES), PREFAULT_MAX_BYTES)) // 4096 * 4096


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    c = libc()
    if c is None:
        return None
    fn = c.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Owns the KV tensor. ``buffer`` lets the pool live in memory someone else provides (shared memory)."""

    def __init__(self, shape: KVShape, device: torch.device, buffer: memoryview | None = None) -> None:
        self.shape = shape
        dims = (shape.num_layers, 2, shape.num_slots, shape.num_kv_heads, shape.head_dim)
        if buffer is not None:
            if device.type != "cpu":
                raise ValueError("an external KV buffer must be host memory")
            flat = torch.frombuffer(buffer, dtype=shape.dtype, count=shape.total_bytes // _itemsize(shape.dtype))
            self.data = flat.view(dims)
        else:
            self.data = torch.empty(dims, dtype=shape.dtype, device=device)
        # The null page (page 0) is what padded reads see: keep it finite.
        self.data[:, :, : shape.page_size].zero_()
        self._prefaulted = 0 if self.data.device.type == "cpu" and buffer is None else self.data.nbytes
        self._piece = PREFAULT_FIRST_BYTES

    @property
    def prefault_pending(self) -> bool:
        return self._prefaulted < self.data.nbytes

    @property
    def prefaulted_ratio(self) -> float:
        """The part of the pool faulted in ahead of use (1.0 when done, and where it is not done ahead: device
        and shared-memory pools, kernels without MADV_POPULATE_WRITE)."""
        return self._prefaulted / self.data.nbytes if self.data.nbytes else 1.0

    def prefault_next(self) -> None:
        """Fault the next piece of a host pool in (MADV_POPULATE_WRITE: the kernel maps and zeroes fresh pages,
        mapped pages and their contents stay as they are, so it is safe beside live KV and other threads' writes),
        the piece sized from the last one's rate to take about PREFAULT_PIECE_S. The engine calls it while idle:
        a fresh pool's pages are otherwise faulted in by the first steps that write them, ~1.1 s for 2 GiB on a
        2-core AMD EPYC, which made the first batch-64 job's 8 x 512-token prefill steps 1.46 s against 1.34 s in
        later jobs. Without the call (kernels before 5.14, no libc found) the pool is faulted in on first use."""
        madvise = _madvise()
        base, end = self.data.data_ptr(), self.data.data_ptr() + self.data.nbytes
        start = base + self._prefaulted
        page = 4096
        lo, hi = start // page * page, min(end, start + self._piece)
        began = time.perf_counter()
        if madvise is None or madvise(lo, (hi - lo + page - 1) // page * page, MADV_POPULATE_WRITE) != 0:
            self._prefaulted = self.data.nbytes  # not supported here: leave it to first use
            return
        self._piece = prefault_piece_bytes(hi - lo, time.perf_counter() - began)
        self._prefaulted = hi - base

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one token's K and V, in every layer, from slot ``src`` to slot ``dst``."""
        self.data[:, :, dst].copy_(self.data[:, :, src])

    def k(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def k_base(self, layer: int) -> int:
        return self.data[layer, 0].data_ptr()

    def v_base(self, layer: int) -> int:
        return self.data[layer, 1].data_ptr()

    def describe(self) -> dict[str, int | str]:
        """The pool's layout as plain values (base address, sizes, dtype name), e.g. for kv_transfer's
        ``KVLayout.packed(**pool.describe())``."""
        s = self.shape
        return {"base": self.data.data_ptr(), "num_layers": s.num_layers, "num_pages": s.num_pages,
                "page_size": s.page_size, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
                "dtype": str(s.dtype).replace("torch.", "")}

