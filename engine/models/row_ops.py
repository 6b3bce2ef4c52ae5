"""The native row kernels of a decoder layer (row_ops.c): RMSNorm (alone or fused with the residual add),
rotate-half RoPE, the MLP's SiLU-and-multiply and the KV write into the pool's slots, for float32 and bfloat16
CPU tensors. The first three replace several small torch ops with one call each; at decode batch sizes those ops
cost their dispatch and allocation, not their arithmetic. The KV write overlaps the cold writes torch's
index_copy_ makes one by one. Callers check ``usable`` and otherwise take their pure-torch path (other devices and
dtypes, hosts without a C compiler)."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine import native

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_NORM_DIM = 16384  # the norm's per-row scratch lives on the stack


@functools.cache
def kernel() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("row_ops.c"))
    if lib is not None:
        lib.splitserve_rms_norm.restype = ctypes.c_int
        lib.splitserve_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float] + \
            [ctypes.c_int] * 2
        lib.splitserve_kv_write.restype = ctypes.c_int
        lib.splitserve_kv_write.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + \
            [ctypes.c_int64] * 4 + [ctypes.c_int]
        lib.splitserve_rope.restype = ctypes.c_int
        lib.splitserve_rope.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + \
            [ctypes.c_int] * 5
        lib.splitserve_silu_mul.restype = ctypes.c_int
        lib.splitserve_silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    return lib


def usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, when every tensor is a CPU tensor of one dtype the kernels take and no graph is recorded."""
    dtype = tensors[0].dtype
    if (dtype not in DTYPE_CODES or torch.is_grad_enabled()
            or any(t.device.type != "cpu" or t.dtype != dtype for t in tensors)):
        return None
    return kernel()


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half RoPE of x [T, heads, D] (heads and D contiguous, tokens any stride) with cos/sin [T, 1, D]
    contiguous, as a new contiguous tensor; None for layouts the kernel does not take."""
    t, heads, dim = x.shape
    if (x.stride(2) != 1 or x.stride(1) != dim or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.shape != (t, 1, dim) or sin.shape != cos.shape):
        return None
    out = torch.empty(t, heads, dim, dtype=x.dtype)
    rc = lib.splitserve_rope(x.data_ptr(), x.stride(0), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads,
                             dim, DTYPE_CODES[x.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"RoPE kernel refused {x.dtype} x {tuple(x.shape)}")
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of the fused projection's output [T, 2 * inter] (gate first), as a new [T, inter]
    tensor; None for layouts the kernel does not take."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        return None
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype)
    if lib.splitserve_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, inter, DTYPE_CODES[gate_up.dtype],
                               torch.get_num_threads()) != 0:
        raise RuntimeError(f"SiLU-and-mul kernel refused {gate_up.dtype} x {tuple(gate_up.shape)}")
    return out


def kv_write(lib: ctypes.CDLL, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> bool:
    """``k_cache[slots] = k`` and ``v_cache[slots] = v`` (caches [slots, kv_heads, D] contiguous; k/v [T, kv_heads,
    D] of the caches' dtype with heads and D contiguous, tokens any stride; slots int64) in one call; False, having
    written nothing, for layouts the kernel does not take."""
    row = k_cache.shape[1] * k_cache.shape[2]
    if (not k_cache.is_contiguous() or not v_cache.is_contiguous() or k_cache.shape != v_cache.shape
            or slots.dtype != torch.int64 or not slots.is_contiguous() or k.shape != v.shape
            or k.shape[1:] != k_cache.shape[1:] or k.shape[0] != slots.shape[0]
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (k, v))):
        return False
    size = k.element_size()
    rc = lib.splitserve_kv_write(k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0],
                                 k.data_ptr(), v.data_ptr(), k.shape[0], row * size, k.stride(0) * size,
                                 v.stride(0) * size, torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"KV write: a slot is outside the pool's {k_cache.shape[0]} slots")
    return True
