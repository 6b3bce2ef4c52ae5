"""The native CPU decode kernel equals plain torch attention over the same pages, for the head layouts of
real models (group sizes 1-8, head dims 32-128), float32 and bfloat16 (and a float32 model over a bfloat16 or
float16 cache), ragged lengths and scattered pages, for a single sequence (its kv heads split into tasks) and for
batches (one task per sequence); both its AVX-512 body (head dims 64/128) and its generic body."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runner.attention.cpu_kernels import decode_attention, decode_kernel, decode_supported

SHAPES = [(4, 4, 32), (8, 2, 64), (28, 4, 128), (32, 8, 128), (64, 8, 64), (16, 16, 64)]  # heads, kv heads, dim


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
                         ids=["f32", "bf16", "f32-bf16cache", "f32-f16cache"])
@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
@pytest.mark.parametrize("lengths,page", [([257], 16), ([1, 17, 100, 257], 16), ([3, 9, 40, 5, 77, 1, 64, 30], 4),
                                          ([5, 70, 33, 600], 32)],
                         ids=["one-seq", "batch", "batch-page4", "batch-page32"])
def test_kernel_matches_sdpa(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                             generic: bool, lengths: list[int], page: int) -> None:
    lib = decode_kernel()
    if lib is None:
        pytest.skip("no C compiler: the pure-torch path is used instead")
    gen = torch.Generator().manual_seed(heads * dim)
    pages = 64
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    lens = torch.tensor(lengths)
    table = torch.stack([torch.randperm(pages - 1, generator=gen)[:20] + 1 for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    out = decode_attention(lib, q, k_cache, v_cache, table, lens, page, dim ** -0.5, generic=generic)
    assert out.dtype == dtype
    for b, n in enumerate(lens.tolist()):
        slots = (table[b].unsqueeze(1) * page + torch.arange(page)).reshape(-1)[:n]
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=dim ** -0.5,
                                             enable_gqa=True).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out[b].float() - ref).abs().max().item() < tol, (b, n)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
def test_a_row_attends_over_its_extra_slots_after_its_pages(heads: int, kv_heads: int, dim: int,
                                                          kv_dtype: torch.dtype, generic: bool) -> None:
    """A draft tree node's row: its first kv_len positions through the page table, then slots named one by one
    (its path, anywhere in the pool); rows without extras are untouched by the others' (lengths 0-5)."""
    lib = decode_kernel()
    if lib is None:
        pytest.skip("no C compiler: the pure-torch path is used instead")
    gen = torch.Generator().manual_seed(7 * heads + dim)
    page, pages = 16, 32
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    lens = torch.tensor([1, 17, 40, 16, 33, 5])
    table = torch.stack([torch.randperm(pages - 1, generator=gen)[:4] + 1 for _ in lens])
    extra_lens = torch.tensor([3, 0, 5, 1, 2, 4])
    extra = torch.randint(page, pages * page, (len(lens), 5), generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    out = decode_attention(lib, q, k_cache, v_cache, table, lens, page, dim ** -0.5, generic=generic,
                           extra_slots=extra, extra_lens=extra_lens)
    for b, n in enumerate(lens.tolist()):
        slots = (table[b].unsqueeze(1) * page + torch.arange(page)).reshape(-1)[:n]
        slots = torch.cat([slots, extra[b, :int(extra_lens[b])]])
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=dim ** -0.5,
                                             enable_gqa=True).squeeze(1)
        assert (out[b] - ref).abs().max().item() < 1e-5, (b, n)


def test_shapes_beyond_the_kernel_decode_through_torch(tiny_model_dir) -> None:  # noqa: ANN001
    """A page size the kernel refuses (over 256 tokens) still serves: the backend takes the gather path."""
    from engine.sampling_params import SamplingParams
    from tests.engine.conftest import make_core

    lib = decode_kernel()
    if lib is not None:
        assert decode_supported(lib, 64, 12, 4, 256) and not decode_supported(lib, 64, 12, 4, 512)
    outputs = []
    for page in (512, 4):
        core = make_core(tiny_model_dir, page_size=page, max_total_tokens=2048)
        assert (core.runner.backend._native is None) == (page == 512 or lib is None)
        req = core.make_request(list(range(20, 60)), SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                    ignore_eos=True), detokenize=False)
        core.run_to_completion([req])
        outputs.append(req.output_ids)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page", [16, 32])
def test_a_row_attends_to_the_same_bits_alone_and_in_a_batch(kv_dtype: torch.dtype, page: int) -> None:
    """A batch's tasks read whole rows (every kv head of a sequence, the next block's rows read through the
    current block's compute); a sequence alone is split by kv head and walks its pages. Both sum in one order."""
    lib = decode_kernel()
    if lib is None:
        pytest.skip("no C compiler: the pure-torch path is used instead")
    heads, kv_heads, dim, pages = 9, 3, 64, 96
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    lens = torch.tensor([1, 16, 17, 95, 300, 513, 40, 33])
    table = torch.stack([torch.randperm(pages - 1, generator=gen)[:40] + 1 for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(kv_dtype)
    batch = decode_attention(lib, q, k_cache, v_cache, table, lens, page, dim ** -0.5)
    for b in range(len(lens)):
        alone = decode_attention(lib, q[b:b + 1], k_cache, v_cache, table[b:b + 1], lens[b:b + 1], page, dim ** -0.5)
        assert torch.equal(alone[0], batch[b]), b


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
@pytest.mark.parametrize("page", [4, 16, 32])
@pytest.mark.parametrize("batch", [1, 6], ids=["alone", "batch"])
def test_a_draft_node_attends_to_the_same_bits_as_plain_decoding(kv_dtype: torch.dtype, generic: bool, page: int,
                                                                 batch: int) -> None:
    """A tree node's keys past its kv_len come from its path's slots (anywhere in the pool); with the same K and V
    there it gets the same bits as a row whose keys all sit in its pages, so an accepted draft's K/V and logits
    are plain decoding's. Lengths end inside a 16-key block, on one, and across a page."""
    lib = decode_kernel()
    if lib is None:
        pytest.skip("no C compiler: the pure-torch path is used instead")
    heads, kv_heads, dim, pages = 9, 3, 64, 200
    gen = torch.Generator().manual_seed(page + batch)
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    cases = [(1, 3), (15, 1), (16, 5), (30, 4), (47, 2), (64, 7), (131, 6), (600, 5)]
    for at in range(0, len(cases), batch):
        group = cases[at:at + batch]
        width = max(n + e for n, e in group) // page + 1
        tables = torch.stack([torch.randperm(pages - 40, generator=gen)[:width] + 40 for _ in group])
        extra = torch.zeros(len(group), 8, dtype=torch.long)
        k_node, v_node = k_cache.clone(), v_cache.clone()
        free = iter(torch.randperm(page * 40, generator=gen).tolist())  # slots of pages 0-39: no table uses them
        for b, (n, e) in enumerate(group):
            for j in range(e):  # the node's path: copies of positions n .. n + e - 1, somewhere else
                pos = n + j
                src = int(tables[b, pos // page]) * page + pos % page
                extra[b, j] = dst = next(free)
                k_node[dst], v_node[dst] = k_cache[src], v_cache[src]
        q = torch.randn(len(group), heads, dim, generator=gen).to(kv_dtype)
        plain = decode_attention(lib, q, k_cache, v_cache, tables, torch.tensor([n + e for n, e in group]), page,
                                 dim ** -0.5, generic=generic)
        node = decode_attention(lib, q, k_node, v_node, tables, torch.tensor([n for n, _ in group]), page,
                                dim ** -0.5, generic=generic, extra_slots=extra,
                                extra_lens=torch.tensor([e for _, e in group]))
        for b, case in enumerate(group):
            assert torch.equal(plain[b], node[b]), case


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page", [4, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (16, 2)])
def test_rows_that_share_pages_get_the_bits_each_gets_alone(kv_dtype: torch.dtype, page: int, heads: int,
                                                            kv_heads: int) -> None:
    """A verification's rows (one sequence's newest token and draft nodes: the same pages, lengths one apart, some
    with extra slots) and samples of one prompt (the same first pages, then their own) are read together where
    they share keys; every row still gets the bits it gets alone."""
    lib = decode_kernel()
    if lib is None:
        pytest.skip("no C compiler: the pure-torch path is used instead")
    dim, pages = 64, 400
    gen = torch.Generator().manual_seed(page * heads)
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=gen).to(kv_dtype)
    width = 700 // page + 2
    seq = torch.randperm(pages - 1, generator=gen)[:width] + 1
    other = seq.clone()
    other[300 // page:] = torch.randperm(pages - 1, generator=gen)[:width - 300 // page] + 1  # parts after 300 keys
    lens = [517, 518, 519, 520, 518, 519, 40, 333, 350, 3, 17, 17]
    tables = torch.stack([seq] * 6 + [seq, seq, other, seq, seq, seq])
    extra_lens = torch.tensor([0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 3])
    extra = torch.randint(1, pages * page, (len(lens), 3), generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(kv_dtype)
    kv_lens = torch.tensor(lens)
    batch = decode_attention(lib, q, k_cache, v_cache, tables, kv_lens, page, dim ** -0.5, extra_slots=extra,
                             extra_lens=extra_lens)
    for b in range(len(lens)):
        alone = decode_attention(lib, q[b:b + 1], k_cache, v_cache, tables[b:b + 1], kv_lens[b:b + 1], page,
                                 dim ** -0.5, extra_slots=extra[b:b + 1], extra_lens=extra_lens[b:b + 1])
        assert torch.equal(alone[0], batch[b]), b
        slots = (tables[b].unsqueeze(1) * page + torch.arange(page)).reshape(-1)[:lens[b]]
        slots = torch.cat([slots, extra[b, :int(extra_lens[b])]])
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=dim ** -0.5,
                                             enable_gqa=True).squeeze(1)
        assert (batch[b].float() - ref).abs().max().item() < (1e-5 if kv_dtype == torch.float32 else 2e-2), b
