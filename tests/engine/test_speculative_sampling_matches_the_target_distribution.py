"""Sampled output with speculation has the target model's distribution. On an 8-token model (so every outcome is
seen often), 4,000 seeded requests draw four tokens with temperature 0.8 and top-k 5 while a random drafter
proposes two at a time: the second and third tokens come from verification rows, accepted or not. Their empirical joint,
given the first token, must fit the target's exact conditional probabilities (transformers on the same checkpoint,
same temperature and top-k) by a chi-square test at p = 1e-4; a token outside the top-k may never appear."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from tests.drafters import RandomDrafter, drafting_always
from tests.engine.conftest import make_core
from tests.helpers import write_hf_checkpoint

VOCAB, N, TEMPERATURE, TOP_K = 8, 4000, 0.8, 5
PROMPT = [1, 5, 3, 6]


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square with ``df`` degrees of freedom (Wilson-Hilferty; z = 3.719: p = 1e-4)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def target_probs(model, prefix: list[int]) -> torch.Tensor:  # noqa: ANN001 - a transformers model
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].double() / TEMPERATURE
    keep = logits.topk(TOP_K).indices
    masked = torch.full_like(logits, -math.inf)
    masked[keep] = logits[keep]
    return torch.softmax(masked, dim=-1)


def test_verified_tokens_follow_the_target_distribution(tmp_path: Path, tiny_model_dir: Path) -> None:
    ckpt = write_hf_checkpoint(tmp_path / "v8", "llama", vocab_size=VOCAB, init=0.15, seed=3,
                               tokenizer_from=tiny_model_dir)
    spec = SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=2)
    core = make_core(ckpt, max_total_tokens=16384, speculative=drafting_always(spec),
                     drafter=RandomDrafter(VOCAB, seed=1))
    seen: Counter[tuple[int, int, int]] = Counter()
    for start in range(0, N, 500):
        reqs = [core.make_request(PROMPT, SamplingParams(max_new_tokens=4, temperature=TEMPERATURE, top_k=TOP_K,
                                                         seed=i, ignore_eos=True), detokenize=False)
                for i in range(start, start + 500)]
        core.run_to_completion(reqs)
        seen.update(tuple(r.output_ids[:3]) for r in reqs)
    assert 0.05 < core.spec.accepted / core.spec.drafted < 0.9, "both accepted and rejected drafts are tested"
    assert core.spec.drafted > 1.5 * core.spec.verifications, "verifications had two drafts"
    core.check_integrity()

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    first = Counter(o[0] for o in seen.elements())
    expected: dict[tuple[int, int, int], float] = {}
    for o1, n1 in first.items():
        p2 = target_probs(model, PROMPT + [o1])
        for o2 in range(VOCAB):
            if p2[o2] == 0:
                continue
            p3 = target_probs(model, PROMPT + [o1, o2])
            for o3 in range(VOCAB):
                if p3[o3] > 0:
                    expected[(o1, o2, o3)] = n1 * float(p2[o2] * p3[o3])
    impossible = [o for o in seen if o not in expected]
    assert not impossible, f"outputs outside the top-k: {impossible[:5]}"
    big = [c for c in expected if expected[c] >= 5]  # cells expected fewer than 5 times are pooled into one
    small_e = sum(v for c, v in expected.items() if c not in big)
    small_o = sum(n for c, n in seen.items() if c not in big)
    stat = sum((seen[c] - expected[c]) ** 2 / expected[c] for c in big)
    cells = len(big)
    if small_e > 0:
        stat += (small_o - small_e) ** 2 / small_e
        cells += 1
    df = cells - len(first)  # one constraint per first token (its count is fixed)
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} over {df} degrees of freedom"
