"""A step's decoder layers in one native call (layer_stack.c): the kernels each Python layer calls (the few-rows
GEMM, the norm, RoPE, the KV write, decode and prefill attention, SiLU-and-multiply) sequenced in C, so a step of
SmolLM2's 30 layers is one ctypes call instead of ~300 Python, ctypes and torch calls. Same kernels, same order,
same inputs: the rows come out bit-identical to the per-layer path, which every step and layout the stack does
not take still runs.

It takes a step whose row count (decode rows: a sequence's next token, or its draft nodes; and prefill chunks'
rows), and the count of rows whose logits are wanted, are ones the few-rows GEMM takes for every linear layer
(the counts each layer's calibration chose; with AVX-512 or AVX2: the output-lanes GEMM's, 1-256 for SmolLM2 on a
Zen 4 host, and every count where it took those), one GEMM function for all of them, on CPU, for float32 or bfloat16 models without per-head QK norms whose
KV pool has the model's dtype. As in ``CausalLM.forward``, the last layer projects out only the rows whose
logits are wanted: a prefill chunk's last. Measured: the prefill of one 128-token prompt of SmolLM2 (bfloat16,
2 threads) spent ~13% of its time in the per-layer path's Python, one core waiting.

``logits`` runs the model's ends in the same call (the embedding and RoPE rows of the step's ids and positions,
the final norm, the LM head and the widening to float32) where the head's GEMM takes the count of rows whose
logits are wanted (``ends_take``): the same kernels and roundings as ``CausalLM``'s, so the same bits. Interleaved
on SmolLM2 at batch 1 (Zen 3, 2 threads, against the layers alone): bfloat16 1.026-1.057x, float32 1.03-1.09x."""
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
from engine.models.linear import FewRowsOperands
from engine.models.llama import CausalLM
from engine.runner.attention.base import AttentionMeta
from engine.runner.attention import cpu_kernels

log = logging.getLogger(__name__)

_p = ctypes.c_void_p
PAGE = 4096  # the scratch's alignment (its buffers are placed at offsets within a page: layer_stack.c)


class _Linear(ctypes.Structure):
    _fields_ = [("w", _p), ("b", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _p), ("ln2", _p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", _p), ("v_cache", _p)]


class _Stack(ctypes.Structure):
    _fields_ = [("gemm", _p), ("norm", _p), ("rope", _p), ("kv_write", _p), ("attention", _p), ("act", _p),
                ("prefill", _p), ("layers", ctypes.POINTER(_Layer)), *[(n, ctypes.c_int) for n in (
                    "num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "page_size", "dtype")],
                ("num_slots", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("gemm_rows", ctypes.c_int), ("embed", _p), ("final_norm", _p), ("head", _Linear), ("head_gemm", _p),
                ("vocab", ctypes.c_int), ("head_rows", ctypes.c_int)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int), ("max_pages", ctypes.c_int), ("max_extra", ctypes.c_int),
                ("threads", ctypes.c_int), ("cos", _p), ("sin", _p), ("slots", _p), ("page_table", _p),
                ("kv_lens", _p), ("extra_slots", _p), ("extra_lens", _p),
                *[(n, ctypes.c_int) for n in ("num_decode", "num_extends", "extend_max_pages", "num_out")],
                *[(n, _p) for n in ("q_starts", "q_lens", "extend_kv_lens", "extend_page_table", "out_rows")],
                ("scratch", _p), ("ids", _p), ("positions", _p), ("rope_cos", _p), ("rope_sin", _p),
                ("rope_rows", ctypes.c_int64), ("logits", _p), ("head_out", _p)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("layer_stack.c"))
    if lib is not None:
        lib.splitserve_layer_stack.restype = ctypes.c_int
        lib.splitserve_layer_stack.argtypes = [ctypes.POINTER(_Stack), ctypes.POINTER(_Step), _p, _p]
        lib.splitserve_layer_stack_scratch.restype = ctypes.c_int64
        lib.splitserve_layer_stack_scratch.argtypes = [ctypes.POINTER(_Stack), ctypes.c_int]
    return lib


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), _p).value or 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LayerStack:
    """Built by ``build`` (None where it cannot run); ``takes`` says which steps it runs, ``run`` runs one."""

    def __init__(self, model: CausalLM, pool: KVPool, scale: float, rows: frozenset[int], beyond: bool,
                 gemm_name: str, operands: list[tuple[tuple[torch.Tensor, torch.Tensor | None], ...]],
                 lib: ctypes.CDLL, prefill: ctypes.CDLL | None, gemm_rows: int,
                 head: FewRowsOperands | None) -> None:
        """``rows``: the row counts every layer's GEMM takes, ``beyond``: and every count above them (the GEMM
        called in pieces of ``gemm_rows``); ``head``: the LM head's operands where ``logits`` runs the model's ends
        too."""
        cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
        # looked up through their modules when built, so an engine built with another GEMM or attention kernel
        # (bench_decode_ab --gemm-base, --attention-base) runs it in the stack too
        kernels = cpu_gemm.few_rows_kernel(), row_ops.kernel(), cpu_kernels.decode_kernel()
        assert all(k is not None for k in kernels)
        gemm, rows_lib, attention = kernels
        self.model, self.rows, self.beyond, self.extends, self._lib = model, rows, beyond, prefill is not None, lib
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
            None if prefill is None else _fn(prefill, "splitserve_prefill_attention"),
            self._layers, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, pool.shape.page_size, row_ops.DTYPE_CODES[dtype], pool.shape.num_slots,
            model.layers[0].input_layernorm.eps, scale, gemm_rows)
        self.head = head
        if head is not None:
            self._stack.embed = model.embed_tokens.weight.data_ptr()
            self._stack.final_norm = model.norm.weight.data_ptr()
            self._stack.head = _Linear(head.weight.data_ptr(), _ptr(head.bias))
            self._stack.head_gemm = _fn(gemm, head.kernel)
            self._stack.vocab = model.embed_tokens.weight.shape[0]
            self._stack.head_rows = cpu_gemm.MAX_ROWS if head.beyond else max(head.rows)
        self._head_out = torch.empty(0, dtype=dtype)  # a bfloat16 head's rows before the widening, kept as scratch
        self._keep = (pool, operands)  # the tensors whose addresses the structures hold
        # the steps' scratch, kept at the largest size a step needed (bounded by the scheduler's step: SmolLM2's
        # 2,048 prefill rows and 128 decode rows ~40 MB in bfloat16): allocated per step, the tens of MB a prefill
        # step's activations take were mapped anew and faulted in at every step
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @classmethod
    def build(cls, model: CausalLM, pool: KVPool, scale: float, native_decode: bool,
              native_prefill: bool = False) -> LayerStack | None:
        """The stack for ``model`` over ``pool`` (``native_decode``: the attention backend decodes with the CPU
        kernel, which the stack calls; ``native_prefill``: it runs prefill chunks through the CPU prefill kernel,
        so the stack takes steps with chunks too), or None where a layer, the pool or the host is one it does not
        take."""
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
        beyond = True
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ops = []
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                got = getattr(linear, "few_rows_operands", lambda: None)()
                if got is None or got.weight.dtype != dtype:
                    return None
                rows = got.rows if rows is None else rows & got.rows
                beyond = beyond and got.beyond
                names.add(got.kernel)
                ops.append((got.weight, got.bias))
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != dtype or not n.weight.is_contiguous() or n.eps != norms[0].eps for n in norms):
                return None
            operands.append(tuple(ops))
        if not rows or len(names) != 1:  # one GEMM function for every layer
            return None
        prefill = cpu_kernels.prefill_kernel() if native_prefill else None
        top = cpu_gemm.MAX_ROWS if beyond else max(rows)
        head = cls._head_of(model, dtype)
        log.info("native layer stack for %d-%s rows (%s)%s%s", min(rows), "" if beyond else max(rows), *names,
                 ", prefill chunks too" if prefill is not None else "", ", the embedding, final norm and LM head too"
                 if head is not None else "")
        return cls(model, pool, scale, rows, beyond, names.pop(), operands, lib, prefill, top, head)

    @staticmethod
    def _head_of(model: CausalLM, dtype: torch.dtype) -> FewRowsOperands | None:
        """The LM head's few-rows operands where the stack can run the model's ends: an untied head, or a tied one's
        packed copy, routed to a few-rows kernel, and a final norm like the layers'."""
        head, norm, embed = model.lm_head, model.norm, model.embed_tokens.weight
        got = getattr(head, "few_rows_operands", lambda: None)() if head is not None else None
        if (got is None or got.weight.dtype != dtype or norm.weight.dtype != dtype or not norm.weight.is_contiguous()
                or norm.eps != model.layers[0].input_layernorm.eps or not embed.is_contiguous()
                or getattr(head, "out_features", None) != embed.shape[0]
                or cpu_gemm.few_rows_kernel() is None or not hasattr(cpu_gemm.few_rows_kernel(), got.kernel)):
            return None
        return got

    def takes(self, meta: AttentionMeta, out_rows: int | None = None) -> bool:
        """Whether ``run`` takes this step: its rows (decode rows, then prefill chunks' where the stack has the
        prefill kernel) and the ``out_rows`` whose logits are wanted (None: every row) at counts every layer's
        GEMM kernel takes."""
        if meta.extends and not self.extends:
            return False
        rows = meta.num_decode + sum(e.q_len for e in meta.extends)
        return self._fits(rows) and (out_rows is None or self._fits(out_rows))

    def _scratch_for(self, rows: int) -> int:
        """The address of scratch for a step of ``rows`` rows, 4 KiB aligned (the buffer grows as steps need)."""
        need = self._lib.splitserve_layer_stack_scratch(ctypes.byref(self._stack), rows) + PAGE
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        return -(-self._scratch.data_ptr() // PAGE) * PAGE

    def _fits(self, rows: int) -> bool:
        return rows in self.rows or (self.beyond and rows > max(self.rows))

    def ends_take(self, out_rows: int) -> bool:
        """Whether ``logits`` takes a step (one ``takes`` takes) whose ``out_rows`` rows give logits: the counts the
        LM head's GEMM takes, as the head's own forward would route them."""
        return self.head is not None and (out_rows in self.head.rows or self.head.beyond)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
            extend_args: tuple[torch.Tensor, ...] | None = None,
            out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's MLP output and the running residual, as the model's layers return them
        (``CausalLM.tail`` turns them into logits or final hidden states): of ``out_rows`` in their order, every
        row's without them. ``extend_args``: the extends' first rows, lengths, kv lengths and page table (int64,
        as the prefill kernel takes them; the attention backend builds them in ``begin``)."""
        model = self.model
        h = model.embed_tokens(input_ids)
        cos, sin = model.rope.table(positions, h.dtype)
        out = h.shape[0] if out_rows is None else out_rows.shape[0]
        residual = torch.empty(out, h.shape[1], dtype=h.dtype)
        step = self._step(h.shape[0], meta, extend_args, out_rows)
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        self._call(step, h.data_ptr(), residual.data_ptr())
        return h[:out], residual  # h held every row's embedding, and now the first `out` rows' output

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, top_position: int, meta: AttentionMeta,
               extend_args: tuple[torch.Tensor, ...] | None = None,
               out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``CausalLM.forward``'s float32 logits of ``out_rows`` (every row without them) from the step's token ids
        and positions (int64; ``top_position`` their largest), the ends in the same call (``ends_take``)."""
        assert self.head is not None
        rows = input_ids.shape[0]
        out = rows if out_rows is None else out_rows.shape[0]
        cos, sin = self.model.rope.tables(top_position + 1)
        vocab = self._stack.vocab
        logits = torch.empty(out, vocab, dtype=torch.float32)
        if self._stack.dtype and self._head_out.numel() < out * vocab:
            self._head_out = torch.empty(out * vocab, dtype=self._head_out.dtype)
        step = self._step(rows, meta, extend_args, out_rows)
        step.ids, step.positions = input_ids.data_ptr(), positions.data_ptr()
        step.rope_cos, step.rope_sin, step.rope_rows = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        step.logits, step.head_out = logits.data_ptr(), self._head_out.data_ptr()
        self._call(step, None, None)
        return logits

    def _step(self, rows: int, meta: AttentionMeta, extend_args: tuple[torch.Tensor, ...] | None,
              out_rows: torch.Tensor | None) -> _Step:
        has_extra = meta.decode_extra_slots is not None and meta.decode_extra_lens is not None
        table = meta.decode_page_table
        ext = extend_args if meta.extends else None
        assert not meta.extends or ext is not None, "a step with extends needs their tables"
        return _Step(rows, table.shape[1], meta.decode_extra_slots.shape[1] if has_extra else 0,
                     torch.get_num_threads(), None, None, meta.out_slots.data_ptr(),
                     table.data_ptr(), meta.decode_kv_lens.data_ptr(),
                     _ptr(meta.decode_extra_slots) if has_extra else None,
                     _ptr(meta.decode_extra_lens) if has_extra else None,
                     meta.num_decode, len(meta.extends), 0 if ext is None else ext[3].shape[1],
                     rows if out_rows is None else out_rows.shape[0],
                     *((None,) * 4 if ext is None else (t.data_ptr() for t in ext)), _ptr(out_rows),
                     self._scratch_for(rows))

    def _call(self, step: _Step, x: int | None, residual: int | None) -> None:
        rc = self._lib.splitserve_layer_stack(ctypes.byref(self._stack), ctypes.byref(step), x, residual)
        if rc == -2:
            raise MemoryError("a kernel of the native layer stack could not allocate its scratch")
        if rc == -3:
            raise IndexError("a token id outside the embedding, or a position outside the RoPE tables")
        if rc != 0:
            raise RuntimeError(f"the native layer stack's kernels refused the step ({rc}, {step.rows} rows)")
