"""The native row kernels (engine/models/row_ops.c) give what the pure-torch paths give: RMSNorm alone and fused
with the residual add (the residual updated in place, rounded as torch rounds it), and rotate-half RoPE on q and
k read in place from the fused QKV output, in float32 and bfloat16, for one row, a decode batch's few and enough
rows to split across threads, and the KV write equals index_copy_ from strided views; inputs they do not take go
through torch."""
from __future__ import annotations

import pytest
import torch

from engine.models.norm import RMSNorm
from engine.models.rope import RotaryEmbedding, rotate
from engine.models.row_ops import kernel as norm_kernel

pytestmark = pytest.mark.skipif(norm_kernel() is None, reason="no C compiler for the native kernel")


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the same roundings; a sum of squares in another order may move a value by one bfloat16 step
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 576), (5, 576), (300, 64), (3, 7)])
def test_norm_and_fused_add_equal_torch(dtype: torch.dtype, rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows * 31 + dim)
    norm = _norm(dim, dtype, dim)
    x = (3 * torch.randn(rows, dim, generator=g)).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    with torch.inference_mode():
        _close(norm(x), norm._torch(x), dtype)
        want_residual = residual + x
        want = norm._torch(want_residual)
        got_residual = residual.clone()
        got = norm.add(x, got_residual)
    assert torch.equal(got_residual, want_residual)  # one add, rounded once, whichever path
    _close(got, want, dtype)


def test_inputs_the_kernel_does_not_take_go_through_torch() -> None:
    norm = _norm(64, torch.float32, 0)
    strided = torch.randn(4, 128)[:, ::2]  # not contiguous
    half = torch.randn(4, 64).half()
    with torch.inference_mode():
        torch.testing.assert_close(norm(strided), norm._torch(strided))
        assert norm(half).dtype == torch.float32  # float32 weight times half rows: torch's promotion
    assert norm._kernel(strided) is None and norm._kernel(half) is None
    assert norm._kernel(torch.randn(2, 64)) is None  # outside inference mode (autograd may need the graph)


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():  # the kernel is for inference only: this is the pure-torch path
        return rotate(x, cos, sin).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 100])
def test_rope_on_the_fused_projection_equals_torch(dtype: torch.dtype, tokens: int) -> None:
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)  # rows strided past v
    cos, sin = RotaryEmbedding(dim, 10000.0, None, 256).table(torch.arange(tokens) * 2 + 3, dtype)
    with torch.inference_mode():
        got = rotate(qk, cos, sin)
    want = _torch_rotate(qk, cos, sin)
    assert got.is_contiguous() and got.shape == want.shape
    if dtype == torch.float32:  # a product may be fused into the add: an ulp apart
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the same three roundings
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_kv_write_equals_index_copy_from_views_of_the_projection(dtype: torch.dtype, rows: int) -> None:
    from engine.models.row_ops import kv_write

    gen = torch.Generator().manual_seed(rows)
    kv_heads, dim, slots_total = 3, 64, 4096
    qkv = torch.randn(rows, 9 + 2 * kv_heads, dim, generator=gen).to(dtype)
    k, v = qkv[:, 9:9 + kv_heads], qkv[:, 9 + kv_heads:]  # strided views, as the model passes them
    slots = torch.randperm(slots_total, generator=gen)[:rows]
    caches = [torch.randn(slots_total, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    want = [c.clone().index_copy_(0, slots, x) for c, x in zip(caches, (k, v))]
    assert kv_write(norm_kernel(), caches[0], caches[1], slots, k, v)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def test_kv_write_refuses_a_slot_outside_the_pool_and_layouts_it_does_not_take() -> None:
    from engine.models.row_ops import kv_write

    cache, other = torch.zeros(16, 2, 16), torch.zeros(16, 2, 16)
    k = torch.ones(2, 2, 16)
    with pytest.raises(IndexError):
        kv_write(norm_kernel(), cache, other, torch.tensor([3, 16]), k, k)
    assert not cache.any() and not other.any()  # checked before anything is written
    assert not kv_write(norm_kernel(), cache, other, torch.tensor([3, 4], dtype=torch.int32), k, k)
    assert not kv_write(norm_kernel(), cache, other, torch.tensor([3, 4]), k.transpose(1, 2).contiguous()
                        .transpose(1, 2), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (4, 19), (300, 128)])
def test_silu_mul_of_the_fused_projection_equals_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    from engine.models.row_ops import silu_mul

    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -88.5, 0.0, 90.0])  # far tails: no overflow, no NaN
    gate, up = gate_up.chunk(2, dim=-1)
    got = silu_mul(norm_kernel(), gate_up)
    want = torch.nn.functional.silu(gate).mul_(up)
    assert got is not None and got.shape == (rows, inter) and got.dtype == dtype and torch.isfinite(got).all()
    if dtype == torch.float32:  # another exp: a few ulps
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the same two roundings around another exp: rarely a bfloat16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
        differ = got != want
        differ[0, :4] = False  # the tails' values under 1e-35 come from two exps that clamp differently
        assert differ.float().mean() < 0.01
    assert silu_mul(norm_kernel(), gate_up[:, 1:]) is None  # strided: the caller's torch path
