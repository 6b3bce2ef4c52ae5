"""Constrained decoding in the engine (tiny model, its own tokenizer): output always matches the grammar;
retraction under memory pressure leaves it exactly as it would have been; jump-forward skips forward passes
without changing validity; stop strings and ignore_eos behave; requests sharing one compiled grammar follow it
independently; the pool ends idle."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from engine.engine_core import EngineCore
from engine.grammar.spec import GrammarSpec
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core

WORDS = r"[a-z]{2,8}( [a-z]{2,8}){3,8}\."
LONG_KEYS = {"type": "object", "additionalProperties": False,
             "properties": {f"field_number_{i}_with_a_rather_long_name": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9} for i in range(4)},
             "required": [f"field_number_{i}_with_a_rather_long_name" for i in range(4)]}


def constrained(core: EngineCore, prompt: list[int], spec: GrammarSpec, **kw: object):  # noqa: ANN201
    sp = SamplingParams(**{"max_new_tokens": 120, "temperature": 0.0, **kw}, grammar=spec)  # type: ignore[arg-type]
    return core.make_request(prompt, sp, grammar=core.grammars.compile(spec).grammar)


def finish(core: EngineCore, reqs: list) -> int:  # noqa: ANN001
    steps = 0
    for r in reqs:
        core.add_request(r)
    while not all(r.finished for r in reqs):
        core.step()
        steps += 1
        assert steps < 2000
    core.check_integrity()
    return steps


def regex_run(model_dir: Path, tokens: int, temperature: float) -> tuple[list[str], int]:
    core = make_core(model_dir, page_size=4, max_total_tokens=tokens, chunk=16)
    rng = random.Random(5)
    spec = GrammarSpec.of_text("regex", WORDS, "regex")
    reqs = [constrained(core, [rng.randrange(10, 4000) for _ in range(20)], spec, temperature=temperature,
                        seed=7 + i, ignore_eos=True) for i in range(8)]
    finish(core, reqs)
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity
    texts = [r.detok.text for r in reqs]
    assert all(re.fullmatch(WORDS, t) for t in texts), texts
    assert all(r.finish_reason == "stop" for r in reqs)  # the grammar ended them, ignore_eos or not
    return texts, core.scheduler.num_retractions


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_retraction_leaves_constrained_output_unchanged(tiny_model_dir: Path, temperature: float) -> None:
    roomy, none = regex_run(tiny_model_dir, 8192, temperature)
    tight, some = regex_run(tiny_model_dir, 160, temperature)
    assert none == 0 and some > 0
    assert tight == roomy


def test_jump_forward_skips_forward_passes_and_stays_valid(tiny_model_dir: Path) -> None:
    spec = GrammarSpec.from_json_schema(LONG_KEYS, "json_schema")
    results = {}
    for jump in (False, True):
        core = make_core(tiny_model_dir, jump_forward=jump)
        req = constrained(core, list(range(10, 30)), spec, max_new_tokens=300)
        steps = finish(core, [req])
        jsonschema.validate(json.loads(req.detok.text), LONG_KEYS)
        results[jump] = (steps, len(req.output_ids))
    (off_steps, off_tokens), (on_steps, _) = results[False], results[True]
    assert off_steps == off_tokens  # one token per step
    assert on_steps * 2 < off_steps  # the fixed keys cost no forward pass of their own


def test_stop_strings_and_max_tokens_still_end_constrained_output(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    spec = GrammarSpec.of_text("regex", r"one two three four five six", "regex")
    stopped = constrained(core, list(range(10, 30)), spec, stop=[" four"])
    cut = constrained(core, list(range(10, 30)), spec, max_new_tokens=2)
    finish(core, [stopped, cut])
    assert stopped.finish_reason == "stop" and stopped.detok.text == "one two three"
    assert cut.finish_reason == "length" and len(cut.output_ids) == 2


def test_requests_sharing_a_grammar_follow_it_independently(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    spec = GrammarSpec.of_text("regex", r"(yes|no) because [a-z ]{5,40}\.", "regex")
    reqs = [constrained(core, [10 + i, 20, 30, 40], spec, temperature=1.0, seed=i) for i in range(6)]
    finish(core, reqs)
    texts = [r.detok.text for r in reqs]
    assert all(re.fullmatch(r"(yes|no) because [a-z ]{5,40}\.", t) for t in texts), texts
    assert len(set(texts)) > 1



def test_a_mask_whose_every_row_failed_to_fill_leaves_the_logits_alone() -> None:
    import torch

    from engine.grammar.masks import MaskFiller

    class Broken:
        def fill(self, bitmask, row):  # noqa: ANN001, ANN202
            raise RuntimeError("matcher already terminated")

    mask = MaskFiller(100).start([None, Broken()]).result()
    assert list(mask.errors) == [1] and mask.filled == []
    logits = torch.zeros(2, 100)
    mask.apply(logits)
    assert torch.equal(logits, torch.zeros(2, 100))
