"""Rotary position embeddings (default, linear and Llama 3 scaling), applied in the rotate-half layout."""
from __future__ import annotations

import math
from typing import Any

import torch

from engine.models import row_ops


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table (float32, grown on demand); `rotate` applies it in place of HF's apply_rotary_pos_emb."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._grow(max_positions)

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for `positions` [T], in `dtype`: looked up once per forward, used by every layer."""
        cos, sin = self.tables(int(positions.max()) + 1 if positions.numel() else 0)
        return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)

    def tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables [P, D], P >= ``positions`` (grown, at least doubling, where short)."""
        if positions > self._cos.shape[0]:
            self._grow(max(positions, 2 * self._cos.shape[0]))
        return self._cos, self._sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] with cos/sin [T, 1, D] (a new tensor; x is left alone): one native
    call where it can (row_ops.c, the same roundings), five torch ops otherwise."""
    lib = row_ops.usable(x, cos, sin)
    out = None if lib is None else row_ops.rope(lib, x, cos, sin)
    if out is not None:
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return (x * cos).add_(rotated)  # x * cos + rotate_half(x) * sin, rounded as HF rounds it
