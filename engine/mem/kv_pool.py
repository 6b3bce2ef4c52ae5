"""The paged KV pool: for every layer one K and one V buffer laid out [num_pages * page_size, kv_heads,
head_dim], all in one allocation [layers, 2, slots, kv_heads, head_dim]. Page p of layer l's K starts at
``k_base(l) + p * page_bytes``; a page is contiguous, so contiguous page runs are contiguous memory."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Owns the KV tensor. ``buffer`` lets the pool live in memory someone else provides (shared memory)."""

    def __init__(self, shape: KVShape, device: torch.device, buffer: memoryview | None = None) -> None:
        self.shape = shape
        dims = (shape.num_layers, 2, shape.num_slots, shape.num_kv_heads, shape.head_dim)
        if buffer is not None:
            if device.type != "cpu":
                raise ValueError("an external KV buffer must be host memory")
            flat = torch.frombuffer(buffer, dtype=shape.dtype, count=shape.total_bytes // _itemsize(shape.dtype))
            self.data = flat.view(dims)
        else:
            self.data = torch.empty(dims, dtype=shape.dtype, device=device)
        # The null page (page 0) is what padded reads see: keep it finite.
        self.data[:, :, : shape.page_size].zero_()

    def k(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def k_base(self, layer: int) -> int:
        return self.data[layer, 0].data_ptr()

    def v_base(self, layer: int) -> int:
        return self.data[layer, 1].data_ptr()

    def describe(self) -> dict[str, int | str]:
        """The pool's layout as plain values (base address, sizes, dtype name), e.g. for kv_transfer's
        ``KVLayout.packed(**pool.describe())``."""
        s = self.shape
        return {"base": self.data.data_ptr(), "num_layers": s.num_layers, "num_pages": s.num_pages,
                "page_size": s.page_size, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
                "dtype": str(s.dtype).replace("torch.", "")}

