"""The sampler's draw (inverting the cumulative distribution at one uniform per row): the native kernel
(engine/sampler.c) and the pure-torch path draw from softmax(x / T), restricted to what filter_probs keeps under
top-k / top-p / min-p, never a token of zero weight; unfiltered, they agree with each other token for token."""
from __future__ import annotations

import pytest
import torch

from engine import sampler
from engine.sampler import Filters, draw, filter_probs

# chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_P001 = {df: v for df, v in enumerate(
    [0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70,
     39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27, 49.73, 51.18, 52.62, 54.05, 55.48, 56.89, 58.30, 59.70,
     61.10, 62.49, 63.87, 65.25, 66.62, 67.99])}


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if sampler._kernel() is None:
            pytest.skip("no C compiler")
    else:
        monkeypatch.setattr(sampler, "_kernel", lambda: None)
    return request.param


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_softmax_at_the_temperature(path: str) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 37, generator=g) * 2  # 37: a vocabulary that is not a multiple of the vector width
    n, temp = 20000, 0.7
    x = logits.expand(n, 37).contiguous()
    tokens = draw(x, list(range(n)), torch.full((n,), temp), torch.rand(n, dtype=torch.float64, generator=g))
    assert chi_square(tokens, torch.softmax(logits[0] / temp, dim=0)) < CHI2_P001[36]


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (37, 0.8, 0.0), (37, 1.0, 0.05), (12, 0.9, 0.02),
                                               (1, 1.0, 0.0), (37, 0.0, 0.0)])
def test_filtered_draws_follow_the_kept_tokens_renormalised(path: str, top_k: int, top_p: float, min_p: float) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 37, generator=g) * 1.5
    n, temp = 20000, 0.9
    probs = torch.softmax(logits / temp, dim=-1)
    kept_p = filter_probs(probs, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    kept = (kept_p > 0).nonzero().squeeze(1)
    filters = Filters(torch.full((n,), top_k), torch.full((n,), top_p), torch.full((n,), min_p))
    tokens = draw(logits.expand(n, 37).contiguous(), list(range(n)), torch.full((n,), temp),
                  torch.rand(n, dtype=torch.float64, generator=g), filters)
    assert torch.isin(tokens, kept).all()
    if len(kept) > 1:
        remap = torch.full((37,), -1, dtype=torch.long)
        remap[kept] = torch.arange(len(kept))
        assert chi_square(remap[tokens], kept_p[kept] / kept_p.sum()) < CHI2_P001[len(kept) - 1]
    else:
        assert len(kept) == 1


def test_filters_keep_the_same_tokens_on_a_large_vocabulary(path: str) -> None:
    """SmolLM2's order of vocabulary, mixed filters per row: every drawn token is one filter_probs keeps, and
    over many draws every kept token of a small nucleus shows up."""
    g = torch.Generator().manual_seed(6)
    vocab, rows = 49157, 6
    x = torch.randn(rows, vocab, generator=g) * 3
    top_k = torch.tensor([vocab, 40, vocab, 7, vocab, 200])
    top_p = torch.tensor([0.5, 1.0, 0.95, 0.9, 1.0, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.3, 0.0])
    temp = torch.tensor([1.0, 0.8, 1.3, 1.0, 0.7, 2.0])
    kept = filter_probs(torch.softmax(x / temp.unsqueeze(1), dim=-1), top_k, top_p, min_p) > 0
    n = 400
    idx = [i % rows for i in range(rows * n)]
    pick = lambda t: t.repeat(n)  # noqa: E731
    tokens = draw(x, idx, pick(temp), torch.rand(len(idx), dtype=torch.float64, generator=g),
                  Filters(pick(top_k), pick(top_p), pick(min_p)))
    for r in range(rows):
        drawn = set(tokens[r::rows].tolist())
        assert drawn <= set(kept[r].nonzero().squeeze(1).tolist()), f"row {r} drew a filtered token"
        if kept[r].sum() <= 10:
            assert drawn == set(kept[r].nonzero().squeeze(1).tolist())


def test_masked_tokens_are_never_drawn_even_at_the_ends_of_the_unit_interval(path: str) -> None:
    vocab = 1000
    x = torch.randn(4, vocab)
    x[:, :10] = float("-inf")
    x[:, -10:] = float("-inf")
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5, 1e-300], dtype=torch.float64)
    tokens = draw(x, [0, 1, 2, 3], torch.ones(4), u)
    assert ((tokens >= 10) & (tokens < vocab - 10)).all()
    assert tokens[0] == 10 and tokens[1] == vocab - 11
    nucleus = Filters(torch.tensor([vocab] * 4), torch.tensor([0.999] * 4), torch.zeros(4))
    filtered = draw(x, [0, 1, 2, 3], torch.ones(4), u, nucleus)
    assert ((filtered >= 10) & (filtered < vocab - 10)).all()


def test_native_and_torch_paths_draw_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    if sampler._kernel() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(5)
    vocab = 49157  # SmolLM2's order of size, not a multiple of the kernel's 64-token chunks
    x = torch.randn(8, vocab, generator=g) * 4
    rows = [7, 0, 3, 3, 5, 1, 6, 2] * 25
    u = torch.rand(len(rows), dtype=torch.float64, generator=g)
    temp = torch.rand(len(rows), generator=g) + 0.3
    native = draw(x, rows, temp, u)
    monkeypatch.setattr(sampler, "_kernel", lambda: None)
    assert draw(x, rows, temp, u).tolist() == native.tolist()


def test_a_row_of_nan_logits_still_gets_a_token_in_the_vocabulary(path: str) -> None:
    x = torch.randn(3, 100)
    x[1] = float("nan")
    tokens = draw(x, [0, 1, 2], torch.ones(3), torch.full((3,), 0.5, dtype=torch.float64))
    assert ((tokens >= 0) & (tokens < 100)).all()
