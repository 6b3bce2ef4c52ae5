"""The output-lanes GEMM (engine/models/lanes_gemm.h, in few_rows_gemm.c's library: weights in blocks of 16 outputs,
bfloat16 in pairs of k with AVX-512 BF16, float32 with AVX-512 or AVX2) equals a float64 product (rounded to
bfloat16 in bfloat16), to within the rounding of its sums, for every row count it takes (tiles of up to 8 rows with
AVX-512, 6 with AVX2, partial ones and the uneven splits of larger counts too), with and without bias, on output
counts that are and are not multiples of its 16-lane blocks and 3-block groups; a row's result does not depend on
how many rows came with it; a packed model routes the counts it calibrated to through it, keeping its copy in place
of the dense weight, or, where it keeps level at a prefill chunk's rows too, every count, without oneDNN's packed
copy; where oneDNN does not beat MKL at a prefill chunk's rows, a float32 model takes it only if it does; and where
oneDNN packs no bfloat16 (AVX2), a bfloat16 model takes it for every count only where it beat the few-rows kernel at
all of them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models import row_calibration
from engine.models.cpu_gemm import can_prepack, few_rows_kernel, lanes_gemm, lanes_pack, lanes_rows_max
from engine.models.linear import FewRowsLinear, PackedLinear
from engine.runner.attention.base import AttentionMeta, ExtendSeq
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

lib = few_rows_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the native kernel")
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(lib is None or lanes_rows_max(lib, d) == 0,
                                                   reason=f"no output-lanes GEMM for {d} on this CPU"))
          for d in (torch.float32, torch.bfloat16)]
# float32: sums of k products in float32; bfloat16: one more rounding of the result
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(960, 576), (49, 64), (7, 334), (130, 18), (16, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_equals_a_float64_product(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    packed = lanes_pack(w)
    for m in [*range(1, 18), 24, 33, 64, 101, 256]:
        x = torch.randn(m, k, generator=g).to(dtype)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = lanes_gemm(lib, x, packed, n, b)
        assert got.shape == (m, n) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=RTOL[dtype], atol=1e-5 * k, msg=f"{m} rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_it_refuses_more_rows_than_it_takes_and_in_bfloat16_an_odd_width(dtype: torch.dtype) -> None:
    w = torch.randn(32, 8).to(dtype)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="refused"):
            lanes_gemm(lib, torch.randn(1, 7).bfloat16(), lanes_pack(w)[: 32 * 7], 32, None)
    fn = lib.splitserve_pair_gemm_bf16 if dtype == torch.bfloat16 else lib.splitserve_lanes_gemm
    m = lanes_rows_max(lib, dtype) + 1  # one call takes no more (lanes_gemm calls it in pieces)
    x, y, packed = torch.randn(m, 8).to(dtype), torch.empty(m, 32, dtype=dtype), lanes_pack(w)
    assert fn(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), m, 32, 8, 1) != 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_rows_than_one_call_takes_go_in_pieces_with_each_rows_bits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(100, 64, generator=g).to(dtype), torch.randn(100, generator=g).to(dtype)
    packed = lanes_pack(w)
    x = torch.randn(2 * lanes_rows_max(lib, dtype) + 37, 64, generator=g).to(dtype)
    whole = lanes_gemm(lib, x, packed, 100, b)
    for start in (0, 255, 256, 300, x.shape[0] - 1):
        assert torch.equal(whole[start:start + 3], lanes_gemm(lib, x[start:start + 3], packed, 100, b)), start


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [95, 31, 17, 48])
def test_it_writes_nothing_past_its_outputs(dtype: torch.dtype, n: int) -> None:
    # a partial last block (n % 16 of 15, 1 or none) is stored under a mask: the rest of the buffer keeps its bits
    g = torch.Generator().manual_seed(n)
    w, k = torch.randn(n, 64, generator=g).to(dtype), 64
    fn = lib.splitserve_pair_gemm_bf16 if dtype == torch.bfloat16 else lib.splitserve_lanes_gemm
    for m in (1, 3, 8, 11):
        x = torch.randn(m, k, generator=g).to(dtype)
        y = torch.full((m * n + 64,), 7.0, dtype=dtype)
        assert fn(x.data_ptr(), lanes_pack(w).data_ptr(), None, y.data_ptr(), m, n, k, 2) == 0
        assert torch.equal(y[m * n:], torch.full((64,), 7.0, dtype=dtype)), f"{m} rows"
        torch.testing.assert_close(y[:m * n].view(m, n).double(), F.linear(x.double(), w.double()),
                                   rtol=RTOL[dtype], atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    packed = lanes_pack(w)
    x = torch.randn(64, 576, generator=g).to(dtype)
    alone = torch.cat([lanes_gemm(lib, x[i:i + 1], packed, 200, b) for i in range(64)])
    for m in (2, 7, 9, 13, 37, 64):  # one tile, uneven tiles, several
        assert torch.equal(lanes_gemm(lib, x[:m], packed, 200, b), alone[:m]), f"{m} rows"


def calibrated_as(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: frozenset[int],
                  beyond: frozenset[int] = frozenset()) -> str:
    """Pins the calibrations a packed model's routing reads (``rows``, and ``beyond`` for the counts above them);
    returns the dtype's name for make_core. The tiny model's weights are too small to time: every layer then goes
    through the routing as a large one would (a float32 model is packed by default where oneDNN beat MKL at a
    prefill chunk's rows: pinned too)."""
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    monkeypatch.setattr("engine.models.linear.CALIBRATE_MIN", 1)
    monkeypatch.setattr(row_calibration, "cached_rows",
                        lambda key, measure, file=None: beyond if "beyond" in key else rows)
    monkeypatch.setattr("engine.models.gemm_timing.onednn_beats_mkl", lambda weight: True)
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_model_keeps_the_lanes_copy_and_routes_its_counts_to_it(
        dtype: torch.dtype, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(tiny_model_dir, dtype=calibrated_as(monkeypatch, dtype, frozenset(range(1, 17)), frozenset({512})))
    layers = [m for m in core.model.modules() if isinstance(m, PackedLinear)]
    name = "splitserve_pair_gemm_bf16" if dtype == torch.bfloat16 else "splitserve_lanes_gemm"
    assert layers and all(m.few_rows_operands().kernel == name for m in layers)
    g = torch.Generator().manual_seed(0)
    for m in layers:
        ops = m.few_rows_operands()
        assert ops.rows == frozenset(range(1, 17))
        assert ops.weight.numel() == -(-m.out_features // 16) * 16 * m.in_features  # the lanes copy, not the dense
        x = torch.randn(17, m.in_features, generator=g).to(dtype)  # 16 rows to the lanes GEMM, 17 to oneDNN
        torch.testing.assert_close(m(x[:16]).float(), m(x)[:16].float(), rtol=2 * RTOL[dtype], atol=2e-2)
    assert core.runner.stack is not None and core.runner.stack.rows == frozenset(range(1, 17))


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_it_keeps_level_at_a_prefill_chunks_rows_it_takes_every_count_and_no_packed_copy_is_kept(
        dtype: torch.dtype, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = calibrated_as(monkeypatch, dtype, frozenset(range(1, 257)), frozenset({512}))
    core = make_core(tiny_model_dir, dtype=name)
    layers = [m for m in core.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.packed is None and m.few_rows_operands().beyond for m in layers)
    g = torch.Generator().manual_seed(1)
    for m in layers[:4]:
        x = torch.randn(600, m.in_features, generator=g).to(dtype)  # three calls of the kernel, 256 rows at most
        whole = m(x)
        assert torch.equal(whole[:5], m(x[:5])) and torch.equal(whole[590:], m(x[590:]))  # each row's own bits
    stack = core.runner.stack
    assert stack is not None and stack.beyond
    chunk = (ExtendSeq(0, 600, 600, torch.arange(150)),)
    assert stack.takes(AttentionMeta(torch.arange(600), 0, torch.ones(0, dtype=torch.long),
                                     torch.ones(0, 1, dtype=torch.long), chunk), out_rows=1)
    ref = make_core(tiny_model_dir, dtype=name, decode_stack="off")
    prompt = list(range(5, 605))  # one 600-row step through the stack, and through the layers
    outs = []
    for c in (core, ref):
        req = c.make_request(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
                             detokenize=False)
        c.run_to_completion([req])
        outs.append(req.output_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("lanes_wins", [True, False])
def test_where_onednn_loses_to_mkl_a_float32_model_takes_it_only_where_it_beats_mkl(
        lanes_wins: bool, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if lanes_rows_max(lib, torch.float32) == 0:
        pytest.skip("no output-lanes GEMM for float32 on this CPU")
    name = calibrated_as(monkeypatch, torch.float32, frozenset(range(1, 257)), frozenset({512}))
    monkeypatch.setattr("engine.models.gemm_timing.onednn_beats_mkl", lambda weight: False)
    asked = []
    monkeypatch.setattr("engine.models.gemm_timing.lanes_beats_mkl",
                        lambda lib_, weight: asked.append(tuple(weight.shape)) or lanes_wins)
    core = make_core(tiny_model_dir, dtype=name)
    packed = [m for m in core.model.modules() if isinstance(m, PackedLinear)]
    assert asked and bool(packed) == lanes_wins
    if lanes_wins:  # every count through it (level at 512 rows): no oneDNN copy
        assert all(m.packed is None and m.few_rows_operands().kernel == "splitserve_lanes_gemm" for m in packed)


@pytest.mark.parametrize("every_count", [True, False])
def test_where_onednn_packs_no_bfloat16_a_model_takes_it_only_where_it_beat_the_kernel_everywhere(
        every_count: bool, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if can_prepack(torch.device("cpu"), torch.bfloat16) or lanes_rows_max(lib, torch.bfloat16) == 0:
        pytest.skip("oneDNN packs bfloat16 here, or no output-lanes GEMM takes it")
    monkeypatch.setattr("engine.models.linear.CALIBRATE_MIN", 1)
    won = frozenset(range(1, 257)) if every_count else frozenset(range(1, 65))
    keys: list[str] = []
    monkeypatch.setattr(row_calibration, "cached_rows", lambda key, measure, file=None: keys.append(key) or (
        frozenset({512}) if "beyond" in key or "widen" in key else won))
    core = make_core(tiny_model_dir, dtype="bfloat16")
    assert any("lanes-vs-kernel-bfloat16" in k for k in keys)
    packed = [m for m in core.model.modules() if isinstance(m, PackedLinear)]
    if every_count:
        assert packed and not any(isinstance(m, FewRowsLinear) for m in core.model.modules())
        assert all(m.packed is None and m.few_rows_operands().kernel == "splitserve_pair_gemm_bf16" for m in packed)
        x = torch.randn(300, packed[0].in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
        whole = packed[0](x)  # two calls, each row its own bits
        assert torch.equal(whole[290:], packed[0](x[290:]))
    else:
        assert not packed
