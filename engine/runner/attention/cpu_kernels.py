"""The paged attention kernels for CPUs, decode (cpu_decode.c) and prefill/extend (cpu_prefill.c), compiled and
loaded by engine/native.py; without a compiler the torch backend falls back to its pure-torch path."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine import native

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.c")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def decode_kernel() -> ctypes.CDLL | None:
    lib = native.load(_SOURCE)
    if lib is not None:
        fn = lib.splitserve_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_int] * 4
        lib.splitserve_decode_supported.restype = ctypes.c_int
        lib.splitserve_decode_supported.argtypes = [ctypes.c_int] * 4
    return lib


def decode_supported(lib: ctypes.CDLL, head_dim: int, num_heads: int, num_kv_heads: int, page_size: int) -> bool:
    """Whether the kernel takes these shapes (head dim and page size up to 256, up to 128 query heads per kv head);
    callers take the pure-torch path otherwise."""
    return bool(lib.splitserve_decode_supported(head_dim, num_heads, num_kv_heads, page_size))


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float,
                     generic: bool = False, extra_slots: torch.Tensor | None = None,
                     extra_lens: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D] contiguous; caches [slots, KVH, D] (their dtype may differ from q's: a float32 model with a
    16-bit cache); page_table [B, max_pages] int64 -> out [B, H, D] in q's dtype. Row b attends over its first
    ``kv_lens[b]`` positions, then, when given, over ``extra_slots[b, :extra_lens[b]]`` (int64; a draft tree
    node's path). ``generic`` skips the vectorized body (AVX-512, or AVX2 over bfloat16 caches; tests compare
    both)."""
    out = torch.empty_like(q)
    b, h, d = q.shape
    has_extra = extra_slots is not None and extra_lens is not None
    rc = lib.splitserve_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), page_table.data_ptr(),
        kv_lens.data_ptr(), extra_slots.data_ptr() if has_extra else None,
        extra_lens.data_ptr() if has_extra else None, b, h, k_cache.shape[1], d, page_size, page_table.shape[1],
        extra_slots.shape[1] if has_extra else 0, scale, _DTYPE_CODES[q.dtype], _DTYPE_CODES[k_cache.dtype],
        torch.get_num_threads(), int(generic))
    if rc == -2:
        raise MemoryError("CPU decode kernel could not allocate its per-thread scratch")
    if rc != 0:
        raise RuntimeError(f"CPU decode kernel refused the shapes (heads={h}, kv_heads={k_cache.shape[1]}, dim={d})")
    return out


@functools.cache
def prefill_kernel() -> ctypes.CDLL | None:
    lib = native.load(_PREFILL_SOURCE)
    if lib is not None:
        fn = lib.splitserve_prefill_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_float] + \
            [ctypes.c_int] * 3
        lib.splitserve_prefill_supported.restype = ctypes.c_int
        lib.splitserve_prefill_supported.argtypes = [ctypes.c_int] * 4
    return lib


def prefill_supported(lib: ctypes.CDLL, head_dim: int, num_heads: int, num_kv_heads: int, page_size: int) -> bool:
    """Whether the prefill kernel takes these shapes (head dims a multiple of 16 up to 256, up to 16 query heads
    per kv head); callers take torch's SDPA otherwise."""
    return bool(lib.splitserve_prefill_supported(head_dim, num_heads, num_kv_heads, page_size))


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                      page_table: torch.Tensor, page_size: int, scale: float) -> None:
    """Causal attention of each sequence's query rows ``q[q_starts[s] : q_starts[s] + q_lens[s]]`` over its first
    ``kv_lens[s]`` cached tokens (its pages in ``page_table`` [nseq, max_pages]; the chunk's own K/V already
    written), into the same rows of ``out``. q, out: [T, H, D] with heads and dims contiguous, rows any stride
    (q may be a view of the fused projection); caches [slots, KVH, D], their dtype may differ from q's; the
    per-sequence tensors int64."""
    t, h, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and out.stride()[1:] == (d, 1) and out.dtype == q.dtype
    rc = lib.splitserve_prefill_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), q_starts.data_ptr(),
        q_lens.data_ptr(), kv_lens.data_ptr(), page_table.data_ptr(), q_lens.shape[0], page_table.shape[1], h,
        k_cache.shape[1], d, page_size, q.stride(0), out.stride(0), scale, _DTYPE_CODES[q.dtype],
        _DTYPE_CODES[k_cache.dtype], torch.get_num_threads())
    if rc == -2:
        raise MemoryError("CPU prefill kernel could not allocate its per-thread scratch")
    if rc != 0:
        raise RuntimeError(f"CPU prefill kernel refused the shapes (heads={h}, kv_heads={k_cache.shape[1]}, dim={d}, "
                           f"q_lens={q_lens.tolist()}, kv_lens={kv_lens.tolist()})")
