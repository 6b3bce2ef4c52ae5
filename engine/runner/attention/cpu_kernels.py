"""Native CPU kernels, compiled on first use with the system C compiler into the user's cache folder (keyed by
source hash and compiler) and loaded with ctypes, which releases the GIL during the call. Without a compiler
the torch backend falls back to its pure-torch path."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    from engine.tiny_model import default_cache_dir
    return default_cache_dir() / "kernels"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: CPU decode attention uses the slower pure-torch path")
        return None
    # FMAs and reassociated (tree) reductions in the dot products; no errno, no trapping math
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast",
             "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    digest = hashlib.sha256(_SOURCE.read_bytes() + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_decode-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run([cc, *flags, str(_SOURCE), "-o", str(out), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if proc.returncode != 0:
                log.warning("compiling the CPU decode kernel failed (using pure torch): %s", proc.stderr[-2000:])
                return None
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.splitserve_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 4
    lib.splitserve_decode_supported.restype = ctypes.c_int
    lib.splitserve_decode_supported.argtypes = [ctypes.c_int] * 4
    return lib


def decode_kernel() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("SPLITSERVE_DISABLE_NATIVE_KERNELS") != "1":
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("CPU decode kernel unavailable (using pure torch): %s", e)
    return _lib


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
