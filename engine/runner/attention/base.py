"""The attention-backend interface. The runner describes a step once (``begin``); every layer then calls
``forward`` with its new q/k/v, and the backend writes k/v into the pool and attends over each sequence's pages.

Tokens are flat: decode sequences (one query token each) come first, rows [0, num_decode); then extend
sequences (prefill chunks), each a contiguous run of rows."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExtendSeq:
    q_start: int  # first row in the flat batch
    q_len: int
    kv_len: int  # tokens attended to, including this chunk
    pages: torch.Tensor  # [ceil(kv_len / page_size)] page indices


@dataclass(frozen=True)
class AttentionMeta:
    out_slots: torch.Tensor  # [T] pool slot of every new token
    num_decode: int
    decode_kv_lens: torch.Tensor  # [num_decode]
    decode_page_table: torch.Tensor  # [num_decode, max_pages], padded with the null page 0
    extends: tuple[ExtendSeq, ...]
    # draft tree nodes: slots a decode row attends over after its first kv_len positions (its path's storage
    # slots, engine/spec/tree.py), [num_decode, max_extra] padded with 0, and how many per row; None: none
    decode_extra_slots: torch.Tensor | None = None
    decode_extra_lens: torch.Tensor | None = None


class AttentionBackend(ABC):
    @abstractmethod
    def begin(self, meta: AttentionMeta) -> None:
        """Prepare per-step state (index tensors, masks) shared by all layers."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens -> attention output [T, H, D]."""
