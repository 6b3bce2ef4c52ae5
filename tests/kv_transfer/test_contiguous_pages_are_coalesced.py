"""Contiguous page runs become one write per K/V buffer; batches never exceed the configured size."""
from __future__ import annotations

import pytest

from kv_transfer import ConfigError, KVLayout, LayoutMismatchError
from kv_transfer.wire.layout import page_runs, split_batches, write_entries, write_runs

SHAPE = dict(num_layers=2, num_pages=100, page_size=4, num_kv_heads=2, head_dim=8, dtype="float16")


def test_runs_merge_only_where_both_sides_are_consecutive() -> None:
    assert page_runs([1, 2, 3, 7, 8], [10, 11, 12, 20, 22]) == [(1, 10, 3), (7, 20, 1), (8, 22, 1)]
    assert page_runs([], []) == []


def test_entries_cover_every_buffer_with_run_lengths() -> None:
    src = KVLayout.packed(1_000_000, **SHAPE)
    dst = KVLayout.packed(9_000_000, **SHAPE)
    page = src.page_bytes
    entries = write_entries(src, dst, write_runs(src, dst, [4, 5, 6, 9], [0, 1, 2, 50]))
    assert len(entries) == 2 * 2 * 2  # 2 runs x (K, V) x 2 layers
    assert entries[0] == (src.k_base[0] + 4 * page, dst.k_base[0], 3 * page)
    assert entries[1] == (src.k_base[0] + 9 * page, dst.k_base[0] + 50 * page, page)
    assert sum(e[2] for e in entries) == 4 * page * 4


def test_strided_layouts_are_not_merged() -> None:
    src = KVLayout.packed(0, **SHAPE)
    dst = KVLayout(**{**SHAPE, "k_base": (0, 10**6), "v_base": (2 * 10**6, 3 * 10**6)},
                   page_stride=src.page_bytes * 2)
    entries = write_entries(src, dst, write_runs(src, dst, [1, 2], [1, 2]))
    assert len(entries) == 2 * 4 and entries[1][1] - entries[0][1] == 2 * src.page_bytes


def test_batches_are_split() -> None:
    entries = [(i, i, 1) for i in range(2500)]
    batches = split_batches(entries, 1024)
    assert [len(b) for b in batches] == [1024, 1024, 452]
    assert [e for b in batches for e in b] == entries


def test_layout_validation_and_comparison() -> None:
    with pytest.raises(ConfigError, match="one K and one V base"):
        KVLayout(**{**SHAPE, "k_base": (0,), "v_base": (0, 1)})
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(**{**SHAPE, "dtype": "float64", "k_base": (0, 1), "v_base": (0, 1)})
    a = KVLayout.packed(0, **SHAPE)
    a.check_compatible(KVLayout.packed(123, **{**SHAPE, "num_pages": 7}))  # pool size may differ
    with pytest.raises(LayoutMismatchError) as info:
        a.check_compatible(KVLayout.packed(0, **{**SHAPE, "head_dim": 16}))
    assert (info.value.field, info.value.local, info.value.remote) == ("head_dim", 8, 16)
