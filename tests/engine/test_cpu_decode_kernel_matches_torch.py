"""The native CPU decode kernel equals plain torch attention over the same pages, for the head layouts of
real models (group sizes 1-8, head dims 32-128), float32 and bfloat16, ragged lengths and scattered pages, for a
single sequence (its kv heads split into tasks) and for batches (one task per sequence)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runner.attention.cpu_kernels import decode_attention, decode_kernel

SHAPES = [(4, 4, 32), (8, 2, 64), (28, 4, 128), (32, 8, 128), (64, 8, 64), (16, 16, 64)]  # heads, kv heads, dim


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,page", [([257], 16), ([1, 17, 100, 257], 16), ([3, 9, 40, 5, 77, 1, 64, 30], 4)],
                         ids=["one-seq", "batch", "batch-page4"])
def test_kernel_matches_sdpa(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, lengths: list[int],
                             page: int) -> None:
    lib = decode_kernel()
    if lib is None:
        pytest.skip("no C compiler: the pure-torch path is used instead")
    gen = torch.Generator().manual_seed(heads * dim)
    pages = 64
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(dtype)
    lens = torch.tensor(lengths)
    table = torch.stack([torch.randperm(pages - 1, generator=gen)[:20] + 1 for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = decode_attention(lib, q, k_cache, v_cache, table, lens, page, dim ** -0.5)
    for b, n in enumerate(lens.tolist()):
        slots = (table[b].unsqueeze(1) * page + torch.arange(page)).reshape(-1)[:n]
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=dim ** -0.5,
                                             enable_gqa=True).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out[b].float() - ref).abs().max().item() < tol, (b, n)
