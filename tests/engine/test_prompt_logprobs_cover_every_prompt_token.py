"""Prompt logprobs (echo with logprobs) cover every prompt token after the first exactly once, whatever the
chunking (one-token chunks included, which the runner batches with decodes), the same values as one unchunked
prefill, and never from the prefix cache (a repeated prompt is recomputed and scores the same)."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core


def scored(core, prompt: list[int], rid: str) -> list[tuple[int, float]]:  # noqa: ANN001
    params = dataclasses.replace(SamplingParams(max_new_tokens=1, temperature=0.0), prompt_logprobs=2)
    req = core.make_request(prompt, params, rid=rid, detokenize=False)
    core.run_to_completion([req])
    assert all(len(lp.top) == 2 for lp in req.prompt_logprobs)
    return [(lp.token_id, lp.logprob) for lp in req.prompt_logprobs]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_every_chunking_scores_every_prompt_token_once(tiny_model_dir: Path, chunk: int) -> None:
    prompt = [random.Random(4).randrange(10, 4000) for _ in range(23)]
    whole = scored(make_core(tiny_model_dir, chunk=512), prompt, "whole")
    assert [t for t, _ in whole] == prompt[1:]
    core = make_core(tiny_model_dir, chunk=chunk)
    other = core.make_request([7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=20, temperature=0.0))
    core.add_request(other)  # a decode running alongside, so one-token chunks share steps with it
    for rid in ("first", "again"):  # the second time the prompt is in the radix cache, and must not be used
        ours = scored(core, prompt, rid)
        assert [t for t, _ in ours] == prompt[1:]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours, whole)) < 1e-4
    core.check_integrity()


def test_prompt_logprobs_survive_the_trip_to_the_decode_worker(tiny_model_dir: Path) -> None:
    """What the prefill worker packs is what the decode worker unpacks; a cut or padded payload is refused."""
    from engine.sampler import pack_logprobs, unpack_logprobs
    core = make_core(tiny_model_dir, chunk=8)
    params = dataclasses.replace(SamplingParams(max_new_tokens=1, temperature=0.0), prompt_logprobs=3)
    req = core.make_request(list(range(30, 50)), params, rid="trip", detokenize=False)
    core.run_to_completion([req])
    data = pack_logprobs(req.prompt_logprobs)
    back = unpack_logprobs(data)
    assert [(b.token_id, b.logprob, b.top) for b in back] == [
        (a.token_id, pytest.approx(a.logprob, abs=1e-6), [(t, pytest.approx(v, abs=1e-6)) for t, v in a.top])
        for a in req.prompt_logprobs]
    assert unpack_logprobs(pack_logprobs([])) == []
    for bad in (data[:-1], data + b"\0", b"", data[:3]):
        with pytest.raises(ValueError):
            unpack_logprobs(bad)
