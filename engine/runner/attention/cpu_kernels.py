"""The paged decode-attention kernel (cpu_decode.c), compiled and loaded by engine/native.py; without a compiler
the torch backend falls back to its pure-torch path."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine import native

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def decode_kernel() -> ctypes.CDLL | None:
    lib = native.load(_SOURCE)
    if lib is not None:
        fn = lib.splitserve_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 4
        lib.splitserve_decode_supported.restype = ctypes.c_int
        lib.splitserve_decode_supported.argtypes = [ctypes.c_int] * 4
    return lib


def decode_supported(lib: ctypes.CDLL, head_dim: int, num_heads: int, num_kv_heads: int, page_size: int) -> bool:
    """Whether the kernel takes these shapes (head dim and page size up to 256, up to 128 query heads per kv head);
    callers take the pure-torch path otherwise."""
    return bool(lib.splitserve_decode_supported(head_dim, num_heads, num_kv_heads, page_size))


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float,
                     generic: bool = False) -> torch.Tensor:
    """q: [B, H, D] contiguous; caches [slots, KVH, D] (their dtype may differ from q's: a float32 model with a
    16-bit cache); page_table [B, max_pages] int64 -> out [B, H, D] in q's dtype. ``generic`` skips the
    AVX-512 body (tests compare both)."""
    out = torch.empty_like(q)
    b, h, d = q.shape
    rc = lib.splitserve_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), page_table.data_ptr(),
        kv_lens.data_ptr(), b, h, k_cache.shape[1], d, page_size, page_table.shape[1], scale,
        _DTYPE_CODES[q.dtype], _DTYPE_CODES[k_cache.dtype], torch.get_num_threads(), int(generic))
    if rc == -2:
        raise MemoryError("CPU decode kernel could not allocate its per-thread scratch")
    if rc != 0:
        raise RuntimeError(f"CPU decode kernel refused the shapes (heads={h}, kv_heads={k_cache.shape[1]}, dim={d})")
    return out
