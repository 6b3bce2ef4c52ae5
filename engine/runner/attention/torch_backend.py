"""Paged attention for CPU and CUDA built on torch: each extend (prefill chunk) attends over its cached prefix
plus itself with a causal mask (SDPA); decodes are batched. On CPU, decodes and extends use the native kernels of
cpu_kernels.py (they read pages in place, all of a step's extends in one call); elsewhere, or without a
compiler, decodes gather a padded page table and extends gather their prefix for SDPA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.mem.kv_pool import KVPool
from engine.models import row_ops
from engine.runner.attention.base import AttentionBackend, AttentionMeta
from engine.runner.attention import cpu_kernels
from engine.runner.attention.cpu_kernels import decode_attention, decode_supported, prefill_attention, prefill_supported


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.scale = head_dim ** -0.5
        self.page_size = pool.shape.page_size
        self._meta: AttentionMeta | None = None
        self._decode_slots = torch.empty(0, dtype=torch.long)
        self._decode_mask = torch.empty(0, dtype=torch.bool)
        self._extend: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        # looked up through the module when built (bench_decode_ab --attention-base and --prefill-attention-base
        # build one with another)
        native = cpu_kernels.decode_kernel() if pool.data.device.type == "cpu" else None
        shape = pool.shape
        if native is not None and not decode_supported(native, head_dim, num_heads, shape.num_kv_heads, self.page_size):
            native = None  # shapes beyond the kernel's limits decode through the gather path
        self._native = native
        prefill = cpu_kernels.prefill_kernel() if pool.data.device.type == "cpu" else None
        if prefill is not None and not prefill_supported(prefill, head_dim, num_heads, shape.num_kv_heads,
                                                         self.page_size):
            prefill = None
        self._prefill = prefill
        self._prefill_args: tuple[torch.Tensor, ...] | None = None

    @property
    def native_decode(self) -> bool:
        """Whether decode rows attend through the CPU decode kernel (cpu_decode.c)."""
        return self._native is not None

    @property
    def native_prefill(self) -> bool:
        """Whether prefill chunks attend through the CPU prefill kernel (cpu_prefill.c)."""
        return self._prefill is not None

    @property
    def extend_args(self) -> tuple[torch.Tensor, ...] | None:
        """The step's extends as the prefill kernel takes them (first rows, lengths, kv lengths, page table), built
        by ``begin``; None without extends or without the kernel."""
        return self._prefill_args

    def begin(self, meta: AttentionMeta) -> None:
        self._meta = meta
        device = self.pool.data.device
        p = self.page_size
        # built only where used: a step the native kernels take builds nothing here (in a batch-1 step, whose weights
        # sweep the caches, this one op took ~40 us)
        offsets = (torch.arange(p, device=device)
                   if (meta.num_decode and self._native is None) or (meta.extends and self._prefill is None) else None)
        if meta.num_decode and self._native is None:
            table = meta.decode_page_table
            slots = (table.unsqueeze(-1) * p + offsets).reshape(table.shape[0], -1)
            width = int(meta.decode_kv_lens.max())
            self._decode_slots = slots[:, :width]
            valid = torch.arange(width, device=device).unsqueeze(0) < meta.decode_kv_lens.unsqueeze(1)
            if meta.decode_extra_slots is not None and meta.decode_extra_lens is not None:  # draft tree paths
                extra = meta.decode_extra_slots
                self._decode_slots = torch.cat([self._decode_slots, extra], dim=1)
                valid = torch.cat([valid, torch.arange(extra.shape[1], device=device).unsqueeze(0)
                                   < meta.decode_extra_lens.unsqueeze(1)], dim=1)
            self._decode_mask = valid[:, None, None, :]  # [B, 1, 1, L]
        self._extend = []
        self._prefill_args = None
        if meta.extends and self._prefill is not None:  # one call per layer for all extends
            width = max(len(seq.pages) for seq in meta.extends)
            table = torch.zeros(len(meta.extends), width, dtype=torch.long)
            for i, seq in enumerate(meta.extends):
                table[i, :len(seq.pages)] = seq.pages
            self._prefill_args = (torch.tensor([seq.q_start for seq in meta.extends]),
                                  torch.tensor([seq.q_len for seq in meta.extends]),
                                  torch.tensor([seq.kv_len for seq in meta.extends]), table)
            return
        for seq in meta.extends:
            slots = (seq.pages.unsqueeze(-1) * p + offsets).reshape(-1)[: seq.kv_len]
            prefix = seq.kv_len - seq.q_len
            mask = None
            if prefix:
                rows = torch.arange(seq.q_len, device=device).unsqueeze(1) + prefix
                mask = torch.arange(seq.kv_len, device=device).unsqueeze(0) <= rows
            self._extend.append((seq.q_start, seq.q_len, slots, mask))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "begin() must be called before forward()"
        k_cache, v_cache = self.pool.k(layer), self.pool.v(layer)
        if k_cache.dtype != q.dtype:  # a narrower cache (--kv-cache-dtype): attend over what the cache keeps, so
            k = k.to(k_cache.dtype)   # a chunk sees its own K/V as later chunks and decodes will
            v = v.to(v_cache.dtype)
        lib = row_ops.usable(k_cache, k, v)
        if lib is None or not row_ops.kv_write(lib, k_cache, v_cache, meta.out_slots, k, v):
            k_cache.index_copy_(0, meta.out_slots, k)
            v_cache.index_copy_(0, meta.out_slots, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode
        if nd and self._native is not None:
            out[:nd] = decode_attention(self._native, q[:nd].contiguous(), k_cache, v_cache, meta.decode_page_table,
                                        meta.decode_kv_lens, self.page_size, self.scale,
                                        extra_slots=meta.decode_extra_slots, extra_lens=meta.decode_extra_lens)
        elif nd:
            qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
            kd = k_cache[self._decode_slots].to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
            vd = v_cache[self._decode_slots].to(q.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self._decode_mask, scale=self.scale,
                                               enable_gqa=True)
            out[:nd] = o.squeeze(2)
        if self._prefill_args is not None:
            prefill_attention(self._prefill, q, k_cache, v_cache, out, *self._prefill_args, self.page_size,
                              self.scale)
        for start, n, slots, mask in self._extend:
            qe = q[start:start + n].transpose(0, 1)  # [H, n, D]
            if mask is None:  # nothing cached before this chunk: attend over the new k/v, no gather
                ke, ve = k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1)
            else:
                ke = k_cache[slots].transpose(0, 1)  # [KVH, L, D]
                ve = v_cache[slots].transpose(0, 1)
            ke, ve = ke.to(q.dtype), ve.to(q.dtype)  # no-ops unless the cache is narrower than the model
            o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        return out
