"""A decode step's decoder layers in one native call (decode_stack.c): the kernels each Python layer calls (the
few-rows GEMM, the norm, RoPE, the KV write, decode attention, SiLU-and-multiply) sequenced in C, so a step of
SmolLM2's 30 layers is one ctypes call instead of ~300 Python, ctypes and torch calls. Same kernels, same order,
same inputs: the rows come out bit-identical to the per-layer path, which mixed steps (decode rows with prefill
chunks) and every layout the stack does not take still run.

It takes a step when every row is a decode row (a sequence's next token, or its draft nodes) and the row count
is one the few-rows GEMM takes for every linear layer (the counts each layer's calibration chose; with AVX-512:
the output-lanes GEMM's, 1-256 for SmolLM2 on a Zen 4 host), one GEMM function for all of them, on CPU, for
float32 or bfloat16 models without per-head QK norms whose KV pool has the model's dtype."""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from engine import native
from engine.mem.kv_pool import KVPool
from engine.models import row_ops
from engine.models import cpu_gemm
from engine.models.llama import CausalLM
from engine.runner.attention.base import AttentionMeta
from engine.runner.attention import cpu_kernels

log = logging.getLogger(__name__)

_p = ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("w", _p), ("b", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _p), ("ln2", _p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", _p), ("v_cache", _p)]


class _Stack(ctypes.Structure):
    _fields_ = [("gemm", _p), ("norm", _p), ("rope", _p), ("kv_write", _p), ("attention", _p), ("act", _p),
                ("layers", ctypes.POINTER(_Layer)), *[(n, ctypes.c_int) for n in (
                    "num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "page_size", "dtype")],
                ("num_slots", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int), ("max_pages", ctypes.c_int), ("max_extra", ctypes.c_int),
                ("threads", ctypes.c_int), ("cos", _p), ("sin", _p), ("slots", _p), ("page_table", _p),
                ("kv_lens", _p), ("extra_slots", _p), ("extra_lens", _p)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("decode_stack.c"))
    if lib is not None:
        lib.splitserve_decode_stack.restype = ctypes.c_int
        lib.splitserve_decode_stack.argtypes = [ctypes.POINTER(_Stack), ctypes.POINTER(_Step), _p, _p]
    return lib


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), _p).value or 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStack:
    """Built by ``build`` (None where it cannot run); ``takes`` says which steps it runs, ``run`` runs one."""

    def __init__(self, model: CausalLM, pool: KVPool, scale: float, rows: frozenset[int], gemm_name: str,
                 operands: list[tuple[tuple[torch.Tensor, torch.Tensor | None], ...]], lib: ctypes.CDLL) -> None:
        cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
        # looked up through their modules when built, so an engine built with another GEMM or attention kernel
        # (bench_decode_ab --gemm-base, --attention-base) runs it in the stack too
        kernels = cpu_gemm.few_rows_kernel(), row_ops.kernel(), cpu_kernels.decode_kernel()
        assert all(k is not None for k in kernels)
        gemm, rows_lib, attention = kernels
        self.model, self.rows, self._lib = model, rows, lib
        self._layers = (_Layer * cfg.num_layers)()
        for i, (layer, ops) in enumerate(zip(model.layers, operands)):
            self._layers[i] = _Layer(layer.input_layernorm.weight.data_ptr(),
                                     layer.post_attention_layernorm.weight.data_ptr(),
                                     *(_Linear(w.data_ptr(), _ptr(b)) for w, b in ops),
                                     pool.k(i).data_ptr(), pool.v(i).data_ptr())
        self._stack = _Stack(
            _fn(gemm, gemm_name),
            _fn(rows_lib, "splitserve_rms_norm"), _fn(rows_lib, "splitserve_rope"),
            _fn(rows_lib, "splitserve_kv_write"), _fn(attention, "splitserve_decode_attention"),
            _fn(rows_lib, "splitserve_silu_mul"),
            self._layers, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, pool.shape.page_size, row_ops.DTYPE_CODES[dtype], pool.shape.num_slots,
            model.layers[0].input_layernorm.eps, scale)
        self._keep = (pool, operands)  # the tensors whose addresses the structures hold

    @classmethod
    def build(cls, model: CausalLM, pool: KVPool, scale: float, native_decode: bool) -> DecodeStack | None:
        """The stack for ``model`` over ``pool`` (``native_decode``: the attention backend decodes with the CPU
        kernel, which the stack calls), or None where a layer, the pool or the host is one it does not take."""
        cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
        lib = _library()
        if (lib is None or not native_decode or cfg.qk_norm or dtype not in row_ops.DTYPE_CODES
                or model.embed_tokens.weight.device.type != "cpu" or pool.shape.dtype != dtype
                or cfg.hidden_size > row_ops.MAX_NORM_DIM or row_ops.kernel() is None
                or cpu_gemm.few_rows_kernel() is None
                or cpu_kernels.decode_kernel() is None):
            return None
        rows: frozenset[int] | None = None
        names = set()
        operands = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ops = []
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                got = getattr(linear, "few_rows_operands", lambda: None)()
                if got is None or got.weight.dtype != dtype:
                    return None
                rows = got.rows if rows is None else rows & got.rows
                names.add(got.kernel)
                ops.append((got.weight, got.bias))
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != dtype or not n.weight.is_contiguous() or n.eps != norms[0].eps for n in norms):
                return None
            operands.append(tuple(ops))
        if not rows or len(names) != 1:  # one GEMM function for every layer
            return None
        log.info("native decode stack for %d-%d rows (%s)", min(rows), max(rows), *names)
        return cls(model, pool, scale, rows, names.pop(), operands, lib)

    def takes(self, meta: AttentionMeta) -> bool:
        """Whether ``run`` takes this step: decode rows only, a row count every layer's GEMM kernel takes."""
        return not meta.extends and meta.num_decode in self.rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's MLP output and the running residual of every row, as the model's layers return them
        (``CausalLM.tail`` turns them into logits or final hidden states)."""
        model = self.model
        h = model.embed_tokens(input_ids)
        cos, sin = model.rope.table(positions, h.dtype)
        residual = torch.empty_like(h)
        has_extra = meta.decode_extra_slots is not None and meta.decode_extra_lens is not None
        table = meta.decode_page_table
        step = _Step(h.shape[0], table.shape[1], meta.decode_extra_slots.shape[1] if has_extra else 0,
                     torch.get_num_threads(), cos.data_ptr(), sin.data_ptr(), meta.out_slots.data_ptr(),
                     table.data_ptr(), meta.decode_kv_lens.data_ptr(),
                     _ptr(meta.decode_extra_slots) if has_extra else None,
                     _ptr(meta.decode_extra_lens) if has_extra else None)
        rc = self._lib.splitserve_decode_stack(ctypes.byref(self._stack), ctypes.byref(step), h.data_ptr(),
                                               residual.data_ptr())
        if rc == -2:
            raise MemoryError("the native decode stack could not allocate its scratch")
        if rc != 0:
            raise RuntimeError(f"the native decode stack's kernels refused the step ({rc}, {h.shape[0]} rows)")
        return h, residual
