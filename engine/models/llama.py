"""One decoder implementation for the Llama family: Llama (incl. Llama 3 RoPE scaling), Qwen2 (QKV bias),
Qwen3 (per-head QK RMSNorm). Tokens arrive flattened ([T]); attention and the KV cache live behind an
``AttentionBackend``, so the model itself holds no paging logic."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import row_ops
from engine.models.config import ArchConfig
from engine.models.norm import RMSNorm
from engine.models.rope import RotaryEmbedding, rotate

if TYPE_CHECKING:
    from engine.runner.attention.base import AttentionBackend


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over every row of ``x`` (their K/V are written), projected out for ``rows`` only (all if None)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            q = rotate(self.q_norm(q.view(t, self.num_heads, self.head_dim)), *rope)
            k = rotate(self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), *rope)
        else:  # q and k sit side by side in the projection: one rotation covers both
            qk = rotate(qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                                  self.head_dim), *rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        out = backend.forward(self.layer_id, q, k, v).reshape(t, self.q_size)
        return self.o_proj(out if rows is None else out[rows])


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        lib = row_ops.usable(gate_up)
        act = None if lib is None else row_ops.silu_mul(lib, gate_up)
        if act is None:  # silu writes a fresh contiguous tensor: a prepacked down_proj would copy the strided half
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the last layer's MLP output (the embeddings for the first layer), ``residual``: the running
        sum of the outputs before it (None for the first layer). Returns this layer's MLP output and the running
        sum, which now includes ``x`` and the attention output: the next norm adds the MLP output in. With
        ``rows``, both for those rows only (every row's K/V is still written)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add(x, residual)
        attn = self.self_attn(h, rope, backend, rows)
        if rows is not None:
            residual = residual[rows]
        h = self.post_attention_layernorm.add(attn, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; ``forward`` returns logits for ``logit_rows`` only."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # built on the meta device and loaded: no random init (Embedding's normal_ on meta imports torch._dynamo,
        # 2-3 s of a start-up on a slow host)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # None when tied to the embeddings (prepacking may still give a tied model a packed copy here)
        self.lm_head: nn.Module | None = (None if cfg.tie_word_embeddings else
                                          nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        with torch.device("cpu"):  # a computed table, not weights: never on the meta device the loader builds on
            self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict,
                                        min(cfg.max_position_embeddings, 8192))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor | None,
                backend: AttentionBackend) -> torch.Tensor:
        """Logits (float32) of ``logit_rows``; with ``logit_rows=None`` the final hidden states of every row
        (after the last norm, before the LM head: ``head`` turns rows of them into logits).

        The last layer computes its output projection and MLP for ``logit_rows`` only: no later layer reads the
        other rows, and their K/V is written before. In a prefill chunk that is most of a layer's GEMMs (SmolLM2:
        84%), 1/30 of the chunk's."""
        h = self.embed_tokens(input_ids)
        rope = self.rope.table(positions, h.dtype)  # once per forward, shared by every layer
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, backend, logit_rows if i == last else None)
        if logit_rows is None or last < 0:
            return self.tail(h, residual, logit_rows)
        return self.head(self.tail(h, residual, None))

    def tail(self, h: torch.Tensor, residual: torch.Tensor | None, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """What ``forward`` returns, from the last layer's output and running residual (None: no layers)."""
        if logit_rows is None:
            return self.norm(h) if residual is None else self.norm.add(h, residual)
        h = self.norm(h[logit_rows]) if residual is None else self.norm.add(h[logit_rows], residual[logit_rows])
        return self.head(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)
        return logits.float()
