"""The sampler's draw (inverting the cumulative distribution at one uniform per row): the native kernel
(engine/sampler.c) and the pure-torch path draw from softmax(x / T) or from given weights, never a token of zero
weight, and agree with each other token for token."""
from __future__ import annotations

import pytest
import torch

from engine import sampler
from engine.sampler import draw

CHI2_DF36_P001 = 67.99  # chi-square critical values at p = 0.001, 36 and 28 degrees of freedom
CHI2_DF28_P001 = 56.89


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
    assert chi_square(tokens, torch.softmax(logits[0] / temp, dim=0)) < CHI2_DF36_P001


def test_draws_follow_given_weights_and_skip_zero_weights(path: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.rand(37, generator=g)
    w[::5] = 0.0
    n = 20000
    tokens = draw(w.expand(n, 37).contiguous(), list(range(n)), None, torch.rand(n, dtype=torch.float64, generator=g))
    assert not torch.isin(tokens, torch.arange(0, 37, 5)).any()
    kept = (w > 0).nonzero().squeeze(1)  # 29 tokens: 28 degrees of freedom
    remap = torch.full((37,), -1, dtype=torch.long)
    remap[kept] = torch.arange(len(kept))
    assert chi_square(remap[tokens], w[kept] / w.sum()) < CHI2_DF28_P001


def test_masked_tokens_are_never_drawn_even_at_the_ends_of_the_unit_interval(path: str) -> None:
    vocab = 1000
    x = torch.randn(4, vocab)
    x[:, :10] = float("-inf")
    x[:, -10:] = float("-inf")
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5, 1e-300], dtype=torch.float64)
    tokens = draw(x, [0, 1, 2, 3], torch.ones(4), u)
    assert ((tokens >= 10) & (tokens < vocab - 10)).all()
    assert tokens[0] == 10 and tokens[1] == vocab - 11


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
