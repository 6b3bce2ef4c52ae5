"""The pair GEMM (engine/models/few_rows_gemm.c, bfloat16 weights in pair blocks of 16 outputs; AVX-512 BF16
only) equals a float64 product rounded to bfloat16, to within the rounding of its pair sums, for every row count
it takes (tiles of up to 8 rows, partial ones and the uneven splits of larger counts too), with and without bias,
on output counts that are and are not multiples of its 16-lane blocks and 3-block groups; a row's result does not
depend on how many rows came with it; and a packed bfloat16 model routes the counts it calibrated to through it,
keeping the pair copy in place of the dense one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import row_calibration
from engine.models.cpu_gemm import can_prepack, few_rows_kernel, pair_gemm, pair_pack, pair_rows_max
from engine.models.linear import PackedLinear
from tests.engine.conftest import make_core

lib = few_rows_kernel()
pytestmark = pytest.mark.skipif(lib is None or pair_rows_max(lib) == 0,
                                reason="no pair GEMM here (no C compiler, or no AVX-512 BF16)")


@pytest.mark.parametrize("n, k", [(960, 576), (49, 64), (7, 334), (130, 18), (16, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_equals_a_float64_product_rounded_to_bfloat16(n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = pair_pack(w)
    for m in [*range(1, 18), 24, 33, 64, 101, 256]:
        x = torch.randn(m, k, generator=g).bfloat16()
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = pair_gemm(lib, x, packed, n, b)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        # one bfloat16 rounding of the result, and float32 sums of k products
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-5 * k, msg=f"{m} rows")


def test_it_refuses_an_odd_width_and_more_rows_than_it_takes() -> None:
    w = torch.randn(32, 8).bfloat16()
    with pytest.raises(RuntimeError, match="refused"):
        pair_gemm(lib, torch.randn(1, 7).bfloat16(), pair_pack(w)[: 32 * 7], 32, None)
    with pytest.raises(RuntimeError, match="refused"):
        pair_gemm(lib, torch.randn(pair_rows_max(lib) + 1, 8).bfloat16(), pair_pack(w), 32, None)


@pytest.mark.parametrize("n", [95, 31, 17, 48])
def test_it_writes_nothing_past_its_outputs(n: int) -> None:
    # a partial last block (n % 16 of 15, 1 or none) is stored under a mask: the rest of the buffer keeps its bits
    g = torch.Generator().manual_seed(n)
    w, k = torch.randn(n, 64, generator=g).bfloat16(), 64
    for m in (1, 3, 8, 11):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = torch.full((m * n + 64,), 7.0, dtype=torch.bfloat16)
        assert lib.splitserve_pair_gemm_bf16(x.data_ptr(), pair_pack(w).data_ptr(), None, y.data_ptr(), m, n, k, 2) == 0
        assert torch.equal(y[m * n:], torch.full((64,), 7.0, dtype=torch.bfloat16)), f"{m} rows"
        torch.testing.assert_close(y[:m * n].view(m, n).double(), F.linear(x.double(), w.double()), rtol=2 ** -8,
                                   atol=1e-3)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    packed = pair_pack(w)
    x = torch.randn(64, 576, generator=g).bfloat16()
    alone = torch.cat([pair_gemm(lib, x[i:i + 1], packed, 200, b) for i in range(64)])
    for m in (2, 7, 9, 13, 37, 64):  # one tile, uneven tiles, several
        assert torch.equal(pair_gemm(lib, x[:m], packed, 200, b), alone[:m]), f"{m} rows"


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16), reason="oneDNN cannot pack bfloat16 here")
def test_a_packed_bfloat16_model_keeps_the_pair_copy_and_routes_its_counts_to_it(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the tiny model's weights are too small to time: let every layer go through the routing as a large one would
    monkeypatch.setattr("engine.models.linear.CALIBRATE_MIN", 1)
    monkeypatch.setattr(row_calibration, "cached_rows", lambda key, measure, file=None: frozenset(range(1, 17)))
    core = make_core(tiny_model_dir, dtype="bfloat16")
    layers = [m for m in core.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.few_rows_operands().kernel == "splitserve_pair_gemm_bf16" for m in layers)
    g = torch.Generator().manual_seed(0)
    for m in layers:
        ops = m.few_rows_operands()
        assert ops.rows == frozenset(range(1, 17))
        assert ops.weight.numel() == -(-m.out_features // 16) * 16 * m.in_features  # the pair copy, not the dense
        x = torch.randn(17, m.in_features, generator=g).bfloat16()  # 16 rows to the pair GEMM, 17 to oneDNN
        torch.testing.assert_close(m(x[:16]).float(), m(x)[:16].float(), rtol=2 ** -7, atol=2e-2)
    assert core.runner.stack is not None and core.runner.stack.rows == frozenset(range(1, 17))
