"""The few-rows float32 GEMM (engine/models/few_rows_gemm.c) equals ``F.linear`` for the row counts it takes
(1-256: in registers up to 7, then in tiles of 4 weight rows x up to 6 rows, partial ones too), with and without
bias, on widths that are and are not multiples of its 16 lanes and 16-row blocks, and a row's result does not
depend on how many rows came with it; so does its bfloat16 body (1-11 rows with AVX-512 BF16; elsewhere every
count, through the float32 tiles, and more than MAX_ROWS in pieces), to bfloat16's rounding; a float32
model on CPU routes its linear layers (and a tied LM head) through it, for the row counts the load-time calibration
found it wins."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import cpu_gemm, gemm_timing, row_calibration
from engine.models.cpu_gemm import (MAX_ROWS, WIDEN_ROWS, can_prepack, few_rows_gemm, few_rows_kernel, max_rows,
                                    onednn_linear)
from engine.models.gemm_timing import best_prefix, calibrate_rows, widened_wins, working_set
from engine.models.linear import FewRowsLinear, use_few_rows_kernel
from engine.models.loader import load_model
from tests.engine.conftest import make_core

lib = few_rows_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the native kernel")
# where the kernel takes bfloat16 at every count (no AVX-512 BF16, so no fast bfloat16 GEMM behind F.linear): larger
# counts may go to it, or widened to MKL's float32 GEMM
bf16_everywhere = pytest.mark.skipif(lib is not None and max_rows(lib, torch.bfloat16) < MAX_ROWS,
                                     reason="this CPU has AVX-512 BF16: the kernel takes a few bfloat16 rows and "
                                            "oneDNN's packed GEMM the rest (no larger counts, no widening)")


@pytest.mark.parametrize("n, k", [(960, 576), (49, 64), (7, 333), (130, 17), (3, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_equals_f_linear(n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for m in [*range(1, 25), 33, 64, 101, 256]:  # up to 7 rows in registers, more in tiles (partial ones too)
        x = torch.randn(m, k, generator=g)
        want = F.linear(x, w, b)
        got = few_rows_gemm(lib, x, w, b)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5), f"{m} rows"
    strided = torch.randn(5, 2 * k, generator=g)[:, :k]  # a non-contiguous input is copied first
    assert torch.allclose(FewRowsLinear(w, b, lib)(strided), F.linear(strided, w, b), rtol=1e-5, atol=1e-4)


def test_a_float32_model_uses_it_and_shares_its_weights(tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # what this host's calibration picks varies (on some hosts the kernel never wins the tiny model's shapes):
    # pin it, so the routing is what is tested
    monkeypatch.setattr(row_calibration, "cached_rows", lambda key, measure, file=None: frozenset(range(1, 9)))
    core = make_core(tiny_model_dir, dtype="float32")
    layers = [m for m in core.model.modules() if isinstance(m, FewRowsLinear)]
    assert len(layers) == 2 * 2 * core.arch.num_layers + (1 if core.model.lm_head is not None else 0)
    assert all(m.rows == frozenset(range(1, 9)) for m in layers)
    monkeypatch.setattr(row_calibration, "cached_rows", lambda key, measure, file=None: frozenset())
    plain = make_core(tiny_model_dir, dtype="float32")  # the kernel won no row count: no layer is routed
    assert not any(isinstance(m, FewRowsLinear) for m in plain.model.modules())
    if core.arch.tie_word_embeddings:
        assert core.model.lm_head.weight.data_ptr() == core.model.embed_tokens.weight.data_ptr()


def test_a_bfloat16_model_that_is_not_packed_gives_its_few_rows_to_the_kernel(tiny_model_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # where oneDNN cannot pack bfloat16 (no AVX-512: F.linear's bfloat16 GEMM was 4x slower than float32 at 64
    # rows on such a host) or packing is off, the kernel takes its bfloat16 rows (at most max_rows) and the rest
    # go to F.linear; the calibration is pinned so the routing is what is tested
    keys: list[str] = []

    def pinned(key: str, measure: object, file: object = None) -> frozenset[int]:
        keys.append(key)
        return frozenset(range(2, 8))
    monkeypatch.setattr(row_calibration, "cached_rows", pinned)
    model, _, _ = load_model(tiny_model_dir, "bfloat16", torch.device("cpu"), "off")
    layers = [m for m in model.modules() if isinstance(m, FewRowsLinear)]
    assert layers and all(m.weight.dtype == torch.bfloat16 and not m.onednn for m in layers)
    assert keys and all("-bf16" in k for k in keys)  # timed, under its own key (not float32's)
    g = torch.Generator().manual_seed(3)
    layer = layers[0]
    for m in (1, 2, 7, 8, 40):  # the pinned rows bit for bit through the kernel, the others through F.linear
        x = torch.randn(m, layer.in_features, generator=g).to(torch.bfloat16)
        want = (few_rows_gemm(lib, x, layer.weight, layer.bias) if 2 <= m <= 7
                else F.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), want), m
        assert torch.allclose(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="no oneDNN float32 GEMM here")
@pytest.mark.parametrize("onednn_won", [True, False])
def test_the_rows_it_does_not_take_go_to_onednn_where_onednn_beat_mkl_here(monkeypatch: pytest.MonkeyPatch,
                                                                            onednn_won: bool) -> None:
    # the host's two answers pinned (which GEMM wins varies by host): the kernel for 1-8 rows, oneDNN or MKL after
    answers = {"onednn-dense-vs-mkl": frozenset({512}) if onednn_won else frozenset(), "": frozenset(range(1, 9))}
    monkeypatch.setattr(row_calibration, "cached_rows",
                        lambda key, measure, file=None: next(v for k, v in answers.items() if k in key))
    onednn_rows: list[int] = []  # the row counts that reached oneDNN

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        onednn_rows.append(x.shape[0])
        return onednn_linear(x, weight, bias)
    monkeypatch.setattr(cpu_gemm, "onednn_linear", counted)
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))  # large enough to be timed (CALIBRATE_MIN)
    assert use_few_rows_kernel(model) == 1
    layer = model[0]
    assert isinstance(layer, FewRowsLinear) and layer.onednn == onednn_won and layer.rows == frozenset(range(1, 9))
    assert (layer.packed is not None) == onednn_won  # oneDNN's rows read a packed copy, not a per-call reorder
    for m in (1, 8, 9, 100, 600):
        x = torch.randn(m, 1024, generator=g)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4), m
    assert onednn_rows == ([9, 100, 600] if onednn_won else [])  # the kernel's rows never, the others by the answer


def test_the_row_counts_it_takes_are_the_ones_it_won_here() -> None:
    """The calibration times the kernel against F.linear for each row count; a FewRowsLinear routes exactly those
    counts to the kernel (the result, unlike the values, depends on the host)."""
    w = torch.randn(3072, 576, generator=torch.Generator().manual_seed(1))
    rows = calibrate_rows(lib, [w], reps=1, passes=1)
    assert rows <= set(range(1, MAX_ROWS + 1))
    assert not rows or rows == set(range(1, max(rows) + 1))  # one range, from 1 row
    layer = FewRowsLinear(w, None, lib, rows=frozenset({3}))
    calls = []
    layer._lib = type("Spy", (), {"splitserve_few_rows_gemm": lambda self, *a: calls.append(a[4]) or
                                  lib.splitserve_few_rows_gemm(*a)})()
    for m in (2, 3, 4):
        x = torch.randn(m, 576)
        assert torch.allclose(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert calls == [3]


def test_the_calibration_keeps_one_range_from_one_row_so_a_noisy_count_neither_punches_a_hole_nor_adds_a_stray(
) -> None:
    saved = {m: 1.0 for m in range(1, 21)} | {m: -1.0 for m in range(21, 33)}
    saved[7] = -0.3  # one noisy loss inside the winning range
    saved[28] = 0.2  # one noisy win far past it
    assert best_prefix(saved) == frozenset(range(1, 21))
    assert best_prefix({m: -1.0 for m in range(1, 9)}) == frozenset()  # the kernel never wins: no rows
    # MKL a little faster at 1-2 rows: the kernel takes them with 3-4, so no row's result depends on its batch
    assert best_prefix({1: -0.5, 2: -0.5, 3: 1.0, 4: 1.0, 5: -5.0}) == frozenset(range(1, 5))
    assert best_prefix({1: -2.0, 2: -2.0, 3: 1.0, 4: 1.0, 5: -5.0}) == frozenset()  # wins that do not pay for 1-2


def test_a_sampled_row_count_stands_for_the_counts_since_the_sample_before_it() -> None:
    dense = {m: 1.0 for m in range(1, 33)}
    # the kernel wins at 40 and 64 by a little, loses at 48 by more per count: 48 stands for 41-48, 64 for 57-64
    assert best_prefix(dense | {40: 1.0, 48: -0.5, 56: 0.1, 64: 1.0}) == frozenset(range(1, 65))
    assert best_prefix(dense | {40: 1.0, 48: -2.0, 56: 0.1, 64: 0.1}) == frozenset(range(1, 41))
    # a win at 96 after losses from 33 to 64: it stands for 65-96, so it pays for them
    losses = {m: -1.0 for m in (40, 48, 56, 64)}
    assert best_prefix(dense | losses | {96: 1.5}) == frozenset(range(1, 97))
    assert best_prefix(dense | losses | {96: 0.5}) == frozenset(range(1, 33))


def test_a_calibrated_layers_row_does_not_depend_on_its_batch() -> None:
    """Whatever the calibration found here, a row's output is bit for bit the same alone and in a batch of any
    count up to the kernel's last (a decode batch, a speculative verification)."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(3072, 576, generator=g), torch.randn(64, 576, generator=g)
    layer = FewRowsLinear(w, None, lib, rows=calibrate_rows(lib, [w], reps=1, passes=1))
    if len(layer.rows) < 2:
        pytest.skip("the kernel won at fewer than 2 row counts on this host: no batch of it to compare")
    alone = layer(x[:1])[0]
    for m in range(2, max(layer.rows) + 1):
        assert torch.equal(layer(x[:m])[0], alone), f"{m} rows"


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(960, 576, generator=g), torch.randn(200, 576, generator=g)
    alone = torch.cat([few_rows_gemm(lib, x[i:i + 1], w, None) for i in range(0, 200, 37)])
    for m in (5, 6, 11, 12, 13, 16, 17, 64, 200):  # both sides of the row-by-row loop and the tiles
        batch = few_rows_gemm(lib, x[:m], w, None)
        assert torch.equal(batch[0:m:37], alone[: len(range(0, m, 37))]), m


@pytest.mark.parametrize("n, k", [(960, 576), (49, 64), (7, 333), (130, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_bfloat16_body_equals_a_float32_product_rounded_to_bfloat16(n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    top = max_rows(lib, torch.bfloat16)
    counts = range(1, top + 1) if top < MAX_ROWS else [*range(1, 33), 63, 64, 200, MAX_ROWS, MAX_ROWS + 5]
    for m in counts:
        x = torch.randn(m, k, generator=g).bfloat16()
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        got = few_rows_gemm(lib, x, w, b)
        assert got.dtype == torch.bfloat16
        # float32 sums differ only in order; the result is then one bfloat16 rounding (2^-8 relative) away
        assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-4 * k), f"{m} rows"
    if top < MAX_ROWS:
        with pytest.raises(RuntimeError, match="refused"):
            few_rows_gemm(lib, torch.zeros(top + 1, k).bfloat16(), w, b)


def test_a_bfloat16_rows_result_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(4)
    top = max_rows(lib, torch.bfloat16)
    n = min(top, 11) if top < MAX_ROWS else 2 * MAX_ROWS + 3  # past the tiles and into a second piece
    w, x = torch.randn(960, 576, generator=g).bfloat16(), torch.randn(n, 576, generator=g).bfloat16()
    alone = torch.cat([few_rows_gemm(lib, x[i:i + 1], w, None) for i in range(n)])
    for m in sorted({*range(2, min(n, 13) + 1), 17, 64, MAX_ROWS + 1, n} & set(range(2, n + 1))):
        assert torch.equal(few_rows_gemm(lib, x[:m], w, None), alone[:m]), m


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every few-rows GEMM call a layer makes from now on."""
    calls: list[int] = []

    def counted(lib_: object, x_: torch.Tensor, w_: torch.Tensor, b_: torch.Tensor | None) -> torch.Tensor:
        calls.append(x_.shape[0])
        return few_rows_gemm(lib_, x_, w_, b_)
    monkeypatch.setattr(cpu_gemm, "few_rows_gemm", counted)
    return calls


@bf16_everywhere
def test_bfloat16_prefill_rows_go_to_the_kernel_where_it_takes_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel takes MAX_ROWS in bfloat16 and won the most rows timed, a layer gives it every larger count
    too; otherwise those go to F.linear."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(MAX_ROWS + 40, 64, generator=g).bfloat16()
    calls = count_kernel_calls(monkeypatch)
    rows = frozenset(range(1, 65))
    with torch.inference_mode():
        FewRowsLinear(w, None, lib, rows=rows, beyond=False)(x)
        assert calls == []
        FewRowsLinear(w, None, lib, rows=rows, beyond=True)(x[:64])
        got = FewRowsLinear(w, None, lib, rows=rows, beyond=True)(x)
    assert calls == [64, MAX_ROWS + 40]
    assert torch.equal(got, torch.cat([few_rows_gemm(lib, x[i:i + 1], w, None) for i in range(len(x))]))


@bf16_everywhere
def test_bfloat16_chunks_of_widen_rows_go_to_float32_mkl_where_that_won(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``widen`` (the host timed MKL on widened operands faster at WIDEN_ROWS), a chunk of that many rows or
    more is computed in float32 and rounded to bfloat16; fewer stay on the kernel."""
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(WIDEN_ROWS + 3, 64, generator=g).bfloat16()
    calls = count_kernel_calls(monkeypatch)
    layer = FewRowsLinear(w, b, lib, rows=frozenset(range(1, 65)), beyond=True, widen=True)
    with torch.inference_mode():
        got = layer(x)
        layer(x[:WIDEN_ROWS - 1])
    assert calls == [WIDEN_ROWS - 1]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x.float(), w.float(), b.float()).bfloat16())


@bf16_everywhere
def test_the_widened_route_is_chosen_only_where_it_timed_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    fast, slow = cpu_gemm.widened_linear, lambda *a: (time.sleep(0.01), fast(*a))[1]
    monkeypatch.setattr(cpu_gemm, "widened_linear", slow)
    assert widened_wins(lib, w, reps=1, passes=1) == frozenset()
    monkeypatch.setattr(cpu_gemm, "widened_linear", fast)
    kernel = cpu_gemm.few_rows_gemm
    monkeypatch.setattr(cpu_gemm, "few_rows_gemm", lambda *a: (time.sleep(0.01), kernel(*a))[1])
    assert widened_wins(lib, w, reps=1, passes=1) == frozenset({WIDEN_ROWS})


def test_the_working_set_passes_the_last_level_cache_or_takes_every_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    weights = [torch.empty(256, 1024) for _ in range(10)]  # 1 MiB each
    monkeypatch.setattr(gemm_timing, "last_level_cache", lambda: 4 << 20)
    assert len(working_set(weights)) == 5  # 5 MiB: a quarter over the 4 MiB cache, so each is read from memory
    monkeypatch.setattr(gemm_timing, "last_level_cache", lambda: 64 << 20)
    assert len(working_set(weights)) == 10  # the whole model fits: all of it, as a step reads it


def test_a_row_count_with_a_clear_winner_is_not_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Further sweeps only for the counts whose first timing was close: a baseline many times slower than the
    kernel is timed in the first sweep alone, one that takes as long as the kernel in every sweep."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    calls: list[int] = []

    def baseline(x: torch.Tensor, i: int) -> torch.Tensor:
        calls.append(x.shape[0])
        time.sleep(0.005)
        return F.linear(x, w)
    assert calibrate_rows(lib, [w], reps=1, passes=3, baseline=baseline, counts=(1, 2)) == {1, 2}
    assert sorted(calls) == [1, 1, 2, 2]  # one sweep: a warm-up and a timed call per count
    calls.clear()
    kernel = cpu_gemm.few_rows_gemm
    monkeypatch.setattr(cpu_gemm, "few_rows_gemm", lambda *a: (time.sleep(0.005), kernel(*a))[1])
    calibrate_rows(lib, [w], reps=1, passes=3, baseline=baseline, counts=(1, 2))
    assert sorted(calls) == [1] * 6 + [2] * 6  # as long as the kernel: three sweeps
