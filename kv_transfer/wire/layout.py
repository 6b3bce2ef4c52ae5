"""KVLayout: where a worker's KV pages live, and the checks both sides of a handshake run on it.

A pool holds, per layer, one K and one V buffer laid out [num_pages, page_size, num_kv_heads,
head_dim]; page p of layer l's K starts at k_base[l] + p * page_stride. Addresses are plain ints,
so a numpy array's `.ctypes.data`, a torch tensor's `data_ptr()` or a SharedSegment's `address`
all work. kv_transfer never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kv_transfer.wire.errors import ConfigError, LayoutMismatchError, PageIndexError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1,
}

# The fields both sides must agree on, in the order they are checked.
COMPARED_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_pages: int
    k_base: tuple[int, ...]
    v_base: tuple[int, ...]
    page_stride: int = 0  # bytes from one page to the next; 0 means page_bytes (dense)
    _stride: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "num_pages"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")
        object.__setattr__(self, "k_base", tuple(int(a) for a in self.k_base))
        object.__setattr__(self, "v_base", tuple(int(a) for a in self.v_base))
        if len(self.k_base) != self.num_layers or len(self.v_base) != self.num_layers:
            raise ConfigError(
                f"KVLayout needs one K and one V base address per layer ({self.num_layers}), "
                f"got {len(self.k_base)} K and {len(self.v_base)} V"
            )
        if self.page_stride and self.page_stride < self.page_bytes:
            raise ConfigError(f"page_stride {self.page_stride} is smaller than a page ({self.page_bytes} bytes)")
        object.__setattr__(self, "_stride", self.page_stride or self.page_bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def stride(self) -> int:
        return self._stride

    @property
    def buffer_bytes(self) -> int:
        """Bytes spanned by one layer's K (or V) buffer."""
        return (self.num_pages - 1) * self._stride + self.page_bytes

    def bases(self) -> tuple[int, ...]:
        """All buffer base addresses: K of each layer, then V of each layer."""
        return self.k_base + self.v_base

    def regions(self) -> list[tuple[int, int]]:
        """(address, length) of every K and V buffer."""
        return [(base, self.buffer_bytes) for base in self.bases()]

    def check_pages(self, pages: Iterable[int], what: str, *, room: int | None = None) -> tuple[int, ...]:
        """The pages as a tuple, or PageIndexError naming the first one outside [0, num_pages)."""
        out = tuple(int(p) for p in pages)
        for p in out:
            if not 0 <= p < self.num_pages:
                raise PageIndexError(
                    f"{what} page index {p} is outside this pool's [0, {self.num_pages})", room=room
                )
        return out

    def check_compatible(self, remote: "KVLayout", *, peer: str | None = None) -> None:
        """Raise LayoutMismatchError naming the first field where `remote` differs."""
        for name in COMPARED_FIELDS:
            mine, theirs = getattr(self, name), getattr(remote, name)
            if mine != theirs:
                raise LayoutMismatchError(name, mine, theirs, peer=peer)

    @staticmethod
    def pool_bytes(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: str) -> int:
        """Bytes of a packed pool (see `packed`): what to allocate or put in a SharedSegment."""
        page = page_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
        return 2 * num_layers * num_pages * page

    @classmethod
    def packed(cls, base: int, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, dtype: str) -> "KVLayout":
        """The layout of one buffer viewed as [num_layers, 2 (K, V), num_pages, page_size, heads, dim]."""
        page = page_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
        layer = num_pages * page
        return cls(
            num_layers=num_layers, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=dtype, num_pages=num_pages,
            k_base=tuple(base + (2 * i) * layer for i in range(num_layers)),
            v_base=tuple(base + (2 * i + 1) * layer for i in range(num_layers)),
        )


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce paired page lists into runs (src_start, dst_start, count) where both are consecutive."""
    assert len(src) == len(dst)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


def write_runs(src: KVLayout, dst: KVLayout, src_pages: Sequence[int],
               dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """The (src_start, dst_start, count) runs one write entry per K/V buffer can cover: consecutive pages are
    merged only where both sides are dense (stride == page bytes); otherwise each page is its own run."""
    if src.stride == src.page_bytes and dst.stride == dst.page_bytes:
        return page_runs(src_pages, dst_pages)
    return [(s, d, 1) for s, d in zip(src_pages, dst_pages)]


def write_entries(src: KVLayout, dst: KVLayout, runs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(src_addr, dst_addr, length) for every K and V buffer and every run of `write_runs`. The layouts must
    already be compatible (same page bytes)."""
    entries: list[tuple[int, int, int]] = []
    page = src.page_bytes
    for s_base, d_base in zip(src.bases(), dst.bases()):
        for s, d, n in runs:
            entries.append((s_base + s * src.stride, d_base + d * dst.stride, n * page))
    return entries


def split_batches(entries: list[tuple[int, int, int]], max_entries: int) -> list[list[tuple[int, int, int]]]:
    return [entries[i:i + max_entries] for i in range(0, len(entries), max_entries)]
