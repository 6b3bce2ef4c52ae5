"""Linear weights prepacked for the CPU GEMM (oneDNN's layout) give F.linear's results for every row count a
step can have (one decode up to a prefill chunk), with and without bias, in float32 and bfloat16; the engine
packs every linear layer (a tied LM head gets a packed copy, the embedding stays dense) with --weight-prepack
on, only bfloat16 models with auto, none with off, and greedy output is the same either way. Packed float32
layers (``on``) send the row counts the few-rows kernel wins at to it, on the dense weight they keep."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine_core import EngineCore
from engine.models.cpu_gemm import can_prepack, few_rows_kernel, lanes_rows_max
from engine.models.linear import PackedLinear, RowRoute, prepack_linears
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_prepack(CPU, torch.float32), reason="torch was built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows: int, dtype: torch.dtype, tol: float, bias: bool) -> None:
    if not can_prepack(CPU, dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = PackedLinear(w, b)(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    assert ((got.float() - ref).abs() / (ref.abs() + 1)).max().item() < tol


def test_prepack_replaces_every_linear_and_packs_a_tied_head() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))
    x = torch.randn(5, 16)
    before = F.linear(model.block(x), model.embed.weight)
    assert prepack_linears(model, tied_lm_head=model.embed.weight) == 3
    assert isinstance(model.block[0], PackedLinear) and isinstance(model.block[2], PackedLinear)
    assert isinstance(model.embed, nn.Embedding)  # the lookup still needs the dense matrix
    torch.testing.assert_close(model.lm_head(model.block(x)), before, rtol=1e-5, atol=1e-5)


def _core(model_dir: Path, prepack: str, dtype: str = "float32") -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model_path=str(model_dir), dtype=dtype, weight_prepack=prepack),
                                   CacheConfig(page_size=4, max_total_tokens=4096)))


def _packed(core: EngineCore) -> set[bool]:
    return {isinstance(m, PackedLinear) for m in core.model.modules() if isinstance(m, (nn.Linear, PackedLinear))}


@pytest.mark.skipif(few_rows_kernel() is None, reason="no C compiler for the few-rows kernel")
@pytest.mark.parametrize("dtype, tol, lanes", [(torch.float32, 1e-4, False), (torch.bfloat16, 3e-2, False),
                                               (torch.float32, 1e-4, True), (torch.bfloat16, 3e-2, True)],
                         ids=["float32", "bfloat16", "float32-lanes", "bfloat16-pairs"])
def test_a_packed_layer_sends_the_few_rows_kernels_counts_to_it(dtype: torch.dtype, tol: float, lanes: bool) -> None:
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    if lanes and lanes_rows_max(few_rows_kernel(), dtype) == 0:
        pytest.skip(f"no output-lanes GEMM for {dtype} on this CPU")
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 80, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    calls: list[int] = []
    real = few_rows_kernel()

    class Spy:  # the kernels, noting the row count of each call
        def __getattr__(self, name: str):  # noqa: ANN204
            def call(*args):  # noqa: ANN002, ANN202
                calls.append(args[4])
                return getattr(real, name)(*args)
            return call

    layer = PackedLinear(w, b, RowRoute(Spy(), frozenset({2}), lanes))
    for rows in (1, 2, 7):
        x = torch.randn(rows, 80, generator=gen).to(dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), w.float(), b.float()), rtol=tol, atol=tol)
    assert calls == [2]
    bf16 = dtype == torch.bfloat16
    assert layer.few_rows_operands().kernel == (("splitserve_pair_gemm_bf16" if bf16 else "splitserve_lanes_gemm")
                                                if lanes else "splitserve_few_rows_gemm_bf16" if bf16 else
                                                "splitserve_few_rows_gemm")


def test_auto_packs_bfloat16_models_only(tiny_model_dir: Path) -> None:
    # where oneDNN cannot pack bfloat16 (an AVX2-only CPU) the model loads dense instead of failing
    assert _packed(_core(tiny_model_dir, "auto", "bfloat16")) == {can_prepack(CPU, torch.bfloat16)}
    assert _packed(_core(tiny_model_dir, "auto", "float32")) == {False}
    assert _packed(_core(tiny_model_dir, "off", "bfloat16")) == {False}
    with pytest.raises(ValueError, match="--weight-prepack must be auto, on or off"):
        _core(tiny_model_dir, "yes")


def test_engine_output_is_the_same_with_and_without_prepacking(tiny_model_dir: Path) -> None:
    outputs = []
    for prepack in ("on", "off"):
        core = _core(tiny_model_dir, prepack)
        assert _packed(core) == {prepack == "on"}
        reqs = [core.make_request([5 + i, 17, 99, 3 * i + 40, 250, 7], SamplingParams(
            max_new_tokens=24, temperature=0.0, ignore_eos=True), detokenize=False) for i in range(4)]
        core.run_to_completion(reqs)
        outputs.append([r.output_ids for r in reqs])
    assert outputs[0] == outputs[1]
