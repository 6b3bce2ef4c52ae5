"""The interface EAGLE-style drafters need: a drafter that asks for the target's hidden states gets, for every
position a request keeps, the target's final hidden state there (the feature that predicted the next token),
exactly once and in order: prompt chunks as they are computed, each decode, and of a tree verification the newest
token and the accepted nodes only (rejected branches never arrive). The features equal those of one forward over
the whole final sequence, and the output is plain decoding's."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.drafters import TreeDrafter, drafting_always
from tests.engine.conftest import make_core
from tests.engine.test_speculative_decoding_is_lossless import NGRAM, prompts


class FeatureReader(TreeDrafter):
    wants_hidden_states = True

    def __init__(self, truth: dict[str, list[int]], vocab: int) -> None:
        super().__init__(truth, vocab)
        self.seen: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def observe_hidden(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        self.seen.setdefault(req.rid, []).extend((start + i, row.clone()) for i, row in enumerate(hidden))


def features_of(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states of every position of ``tokens``, in one prefill."""
    core = make_core(model_dir)
    core.runner.hidden = True
    got: list[torch.Tensor] = []
    forward = core.runner.forward
    core.runner.forward = lambda batch: (out := forward(batch), got.append(out.hidden))[0]
    req = core.make_request(tokens, SamplingParams(max_new_tokens=1, temperature=0), detokenize=False)
    core.run_to_completion([req])
    return got[0]


def test_every_kept_position_reports_the_target_feature_once(tiny_model_dir: Path) -> None:
    ps = prompts(3, seed=4)
    sp = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    plain = make_core(tiny_model_dir)
    want = [plain.make_request(p, sp, rid=f"r{i}", detokenize=False) for i, p in enumerate(ps)]
    plain.run_to_completion(want)
    reader = FeatureReader({r.rid: r.output_ids for r in want}, 4000)
    core = make_core(tiny_model_dir, chunk=8, speculative=drafting_always(NGRAM), drafter=reader)
    assert core.runner.hidden
    got = [core.make_request(p, sp, rid=f"r{i}", detokenize=False) for i, p in enumerate(ps)]
    core.run_to_completion(got)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert core.spec.drafted > core.spec.accepted > 0, "trees verified, some branches rejected"
    for req in got:
        seen = reader.seen[req.rid]
        sequence = req.prompt_ids + req.output_ids
        # every position whose token was computed: all but the last output token (never fed back)
        assert [pos for pos, _ in seen] == list(range(len(sequence) - 1))
        ref = features_of(tiny_model_dir, sequence[:-1])
        assert (torch.stack([row for _, row in seen]) - ref).abs().max().item() < 1e-4
