"""Draft-model speculation changes how many target forwards a request takes, never what it outputs: with the tiny
model as its own draft (nearly every draft accepted, so the target's forward count drops) and with a differently
seeded tiny model as the draft (most drafts rejected), a mixed batch with retraction and aborts gives the same
tokens as without speculation; afterwards both pools pass their integrity checks and every page of both returns.
A draft model whose vocabulary differs from the target's is refused at start-up, naming the flag. (The tiny draft
costs about as much as the tiny target, so the speculator's cost gate would rightly keep it off most steps:
``drafting_always`` turns the gate off to exercise drafting on every step.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config import EngineConfigError, SpeculativeConfig
from engine.engine_core import EngineCore
from engine.tiny_model import write_tiny_model
from tests.drafters import CountingForwards, drafting_always
from tests.engine.conftest import make_core
from tests.engine.test_speculative_decoding_is_lossless import K, outcome, params, prompts, run


def draft_config(path: Path, k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig(speculative_algorithm="draft_model", speculative_draft_model_path=str(path),
                             speculative_num_draft_tokens=k)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-seed-7", seed=7)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[float, list]:
    ps = prompts(8)
    return {t: run(make_core(tiny_model_dir), ps, [params(i, t) for i in range(8)]) for t in (0.0, 0.3)}


def draft_pool_idle(core: EngineCore) -> None:
    core.check_integrity()
    drafter = core.spec.drafter
    assert drafter.allocator.available == drafter.allocator.capacity, "a draft page leaked"


@pytest.mark.parametrize("temperature", [0.0, 0.3], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("pool", [8192, 160], ids=["roomy", "tight"])
def test_output_is_identical_with_a_draft_model(tiny_model_dir: Path, other_draft: Path, reference: dict,
                                                draft: str, temperature: float, pool: int) -> None:
    core = make_core(tiny_model_dir, max_total_tokens=pool,
                     speculative=drafting_always(draft_config(tiny_model_dir if draft == "self" else other_draft)))
    got = run(core, prompts(8), [params(i, temperature) for i in range(8)])
    assert outcome(got) == outcome(reference[temperature])
    draft_pool_idle(core)
    if pool == 160:
        assert core.scheduler.num_retractions > 0, "the tight pool was meant to retract"
    spec = core.spec
    assert spec.drafted > 0
    if draft == "self" and temperature == 0.0:  # the same weights; rows computed in other batch shapes round
        assert spec.accepted >= 0.9 * spec.drafted  # differently, so a near-tie may go the other way
    if draft == "other":
        assert spec.accepted <= 0.5 * spec.drafted


def test_a_self_draft_cuts_the_target_forwards(tiny_model_dir: Path, reference: dict) -> None:
    ref = reference[0.0][1]  # 60 tokens
    core = make_core(tiny_model_dir, speculative=drafting_always(draft_config(tiny_model_dir)))
    forwards = CountingForwards(core)
    (got,) = run(core, [ref.prompt_ids], [ref.sampling])
    assert got.output_ids == ref.output_ids
    plain = 60  # one forward per token without drafts
    assert forwards.count <= plain // 3, f"{forwards.count} target forwards for 60 tokens with k={K}"
    draft_pool_idle(core)


def test_aborts_and_long_prompts_leave_no_draft_page_behind(tiny_model_dir: Path, reference: dict) -> None:
    """Aborted mid-draft, and prompts longer than one step's draft prefill budget (caught up over steps)."""
    from engine.spec import draft_model

    ref = reference[0.0]
    budget = draft_model.PREFILL_BUDGET
    draft_model.PREFILL_BUDGET = 16  # every prompt here takes the draft several steps to prefill
    try:
        core = make_core(tiny_model_dir, speculative=drafting_always(draft_config(tiny_model_dir)))
        got = run(core, prompts(8), [params(i) for i in range(8)], abort_after=12)
    finally:
        draft_model.PREFILL_BUDGET = budget
    for i, r in enumerate(got):
        want = ref[i].output_ids
        assert r.output_ids == (want[:len(r.output_ids)] if r.finish_reason == "abort" else want)
    assert core.spec.accepted > 0
    draft_pool_idle(core)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = shutil.copytree(tiny_model_dir, tmp_path / "draft")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(EngineConfigError, match="--speculative-draft-model-path"):
        make_core(tiny_model_dir, speculative=draft_config(other))


def test_draft_model_flags_go_together(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineConfigError, match="give both or neither"):
        make_core(tiny_model_dir, speculative=SpeculativeConfig(speculative_draft_model_path=str(tiny_model_dir)))
    with pytest.raises(EngineConfigError, match="give both or neither"):
        make_core(tiny_model_dir, speculative=SpeculativeConfig(speculative_algorithm="draft_model"))


def test_a_request_dropped_without_release_gives_its_draft_pages_back(tiny_model_dir: Path) -> None:
    import gc

    from engine.sampling_params import SamplingParams

    core = make_core(tiny_model_dir, speculative=draft_config(tiny_model_dir))
    drafter = core.spec.drafter
    req = core.make_request(prompts(1)[0], SamplingParams(max_new_tokens=8), detokenize=False)
    req.output_ids = [11]
    (draft,) = drafter.propose([req], [K])
    assert len(draft) == K and drafter.allocator.available < drafter.allocator.capacity
    del req
    gc.collect()
    drafter.propose([], [])
    assert drafter.allocator.available == drafter.allocator.capacity
    drafter.check_integrity()
