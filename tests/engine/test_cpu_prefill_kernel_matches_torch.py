"""The native CPU prefill kernel equals torch's causal attention (SDPA with an explicit mask) over the same pages,
for several sequences in one call: chunks with and without a cached prefix, one-token chunks, chunks longer
than a task's block, ragged lengths over scattered pages of sizes 1-32, the head layouts of real models (group
sizes 1-8, head dims 32-128, and 80, which takes the generic body), float32 and bfloat16 (and a float32 model
over a 16-bit cache), with q read from a strided view of the fused projection as the model passes it."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine.runner.attention.cpu_kernels import prefill_attention, prefill_kernel, prefill_supported

SHAPES = [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 80), (32, 4, 128)]  # heads, kv heads, dim
SEQS = {  # (query rows, cached prefix) per sequence
    "fresh-and-prefixed": [(17, 0), (5, 40), (64, 100)],
    "tiny": [(1, 0), (2, 3), (1, 30)],
    "long": [(300, 0)],
}


def _run(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, page: int,
         seqs: list[tuple[int, int]], seed: int) -> float:
    lib = prefill_kernel()
    if lib is None:
        pytest.skip("no C compiler: SDPA is used instead")
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(q + p) // page) for q, p in seqs) + 8
    k_cache = torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    rows = sum(q for q, _ in seqs)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q = qkv[:, :heads]  # a strided view, as the model passes it
    out = torch.full((rows, heads, dim), float("nan"), dtype=dtype)
    width = max(-(-(q_len + pre) // page) for q_len, pre in seqs)
    perm = torch.randperm(num_pages - 1, generator=gen) + 1  # scattered pages, none shared, never page 0
    table = torch.zeros(len(seqs), width, dtype=torch.long)
    used = 0
    for i, (q_len, pre) in enumerate(seqs):
        n = -(-(q_len + pre) // page)
        table[i, :n] = perm[used:used + n]
        used += n
    starts = torch.tensor([0, *itertools.accumulate(q_len for q_len, _ in seqs)][:-1])
    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    kv_lens = torch.tensor([q_len + pre for q_len, pre in seqs])
    prefill_attention(lib, q, k_cache, v_cache, out, starts, q_lens, kv_lens, table, page, dim ** -0.5)
    assert out.dtype == dtype
    return _worst_difference(q, k_cache, v_cache, out, table, page, seqs, torch.float32)


def _worst_difference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      table: torch.Tensor, page: int, seqs: list[tuple[int, int]], ref_dtype: torch.dtype) -> float:
    """The largest difference between the kernel's ``out`` and masked SDPA in ``ref_dtype`` over the same pages
    (sequences' rows one after another in q and out)."""
    worst, start, dim = 0.0, 0, q.shape[-1]
    for i, (q_len, pre) in enumerate(seqs):
        n = q_len + pre
        slots = (table[i].unsqueeze(1) * page + torch.arange(page)).reshape(-1)[:n]
        k, v = k_cache[slots].to(ref_dtype).transpose(0, 1), v_cache[slots].to(ref_dtype).transpose(0, 1)
        rows_i = slice(start, start + q_len)
        mask = torch.arange(n).unsqueeze(0) <= (torch.arange(q_len) + pre).unsqueeze(1)
        ref = F.scaled_dot_product_attention(q[rows_i].to(ref_dtype).transpose(0, 1), k, v, attn_mask=mask,
                                             scale=dim ** -0.5, enable_gqa=True).transpose(0, 1)
        assert torch.isfinite(out[rows_i]).all()
        worst = max(worst, (out[rows_i].to(ref_dtype) - ref).abs().max().item())
        start += q_len
    return worst


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
                         ids=["f32", "bf16", "f32-bf16cache", "f32-f16cache"])
@pytest.mark.parametrize("page", [16, 4, 1, 32])
@pytest.mark.parametrize("seqs", list(SEQS.values()), ids=list(SEQS))
def test_kernel_matches_masked_sdpa(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                                    page: int, seqs: list[tuple[int, int]]) -> None:
    worst = _run(heads, kv_heads, dim, dtype, kv_dtype, page, seqs, seed=heads * dim + page)
    assert worst < (2e-5 if dtype == torch.float32 else 2e-2)


def test_kernel_refuses_shapes_it_does_not_take() -> None:
    lib = prefill_kernel()
    if lib is None:
        pytest.skip("no C compiler")
    assert prefill_supported(lib, 64, 9, 3, 16) and prefill_supported(lib, 256, 32, 2, 1)
    assert not prefill_supported(lib, 72, 8, 8, 16)  # not a multiple of 16
    assert not prefill_supported(lib, 512, 8, 8, 16)
    assert not prefill_supported(lib, 64, 34, 2, 16)  # 17 query heads per kv head
    assert not prefill_supported(lib, 64, 9, 2, 16)  # heads not a multiple of kv heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seqs", [[(300, 0)], [(40, 260), (7, 0)]], ids=["fresh", "prefixed"])
def test_kernel_matches_sdpa_when_scores_climb_along_the_keys(dtype: torch.dtype,
                                                              seqs: list[tuple[int, int]]) -> None:
    """Scores that rise along the keys (by ~11 a 32-key block, to ~100: each row's softmax is its latest keys) make
    the running max move past the kernel's margin again and again, and by less within blocks: a max kept too long
    overflows the weights, one moved without rescaling the output so far weighs old keys wrongly."""
    lib = prefill_kernel()
    if lib is None:
        pytest.skip("no C compiler: SDPA is used instead")
    heads, kv_heads, dim, page = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(7)
    total = sum(q + p for q, p in seqs)
    pages = -(-total // page) + len(seqs)
    k_cache = 0.1 * torch.randn(pages * page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen)
    table = torch.zeros(len(seqs), pages, dtype=torch.long)
    slot = 0
    for i, (q_len, pre) in enumerate(seqs):
        n = -(-(q_len + pre) // page)
        table[i, :n] = torch.arange(slot // page, slot // page + n)
        k_cache[slot:slot + q_len + pre, :, 0] = (0.35 * torch.arange(q_len + pre)).unsqueeze(1)  # 0.35 a key
        slot += n * page
    rows = sum(q for q, _ in seqs)
    q = 0.1 * torch.randn(rows, heads, dim, generator=gen)
    q[:, :, 0] = 8.0
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    out = torch.empty_like(q)
    starts = torch.tensor([0, *itertools.accumulate(q_len for q_len, _ in seqs)][:-1])
    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    kv_lens = torch.tensor([q_len + pre for q_len, pre in seqs])
    prefill_attention(lib, q, k_cache, v_cache, out, starts, q_lens, kv_lens, table, page, dim ** -0.5)
    # float32: scores near 100 are rounded to ~1e-5 before exp (the kernel before the margin: 3.2e-5 here)
    worst = _worst_difference(q, k_cache, v_cache, out, table, page, seqs, torch.float64)
    assert worst < (1e-4 if dtype == torch.float32 else 2e-2)
