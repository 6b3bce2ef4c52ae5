"""On SmolLM2, in float32 and in bfloat16 (where the few-rows GEMM sits beside oneDNN's packed one), the native
layer stack's logits equal the per-layer path's for every forward of a mixed run: plain decode steps, steps with
prefill chunks, and n-gram draft-tree verifications (tests/engine/test_layer_stack_matches_the_layers.py has the
mechanics on the tiny models)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine.models.source import ModelSource
from tests.drafters import drafting_always
from tests.engine.conftest import make_core
from tests.engine.test_layer_stack_matches_the_layers import check_mixed_run, pin_kernel_rows
from tests.engine.test_speculative_decoding_is_lossless import NGRAM


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_steps_and_verifications_match(smollm2: ModelSource, dtype: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pin_kernel_rows(monkeypatch)  # (where the host packs the weights, its own answers)
    # 8-token chunks: the prompts (14-31 tokens) take two to four each, the first step 40 rows of them
    core = make_core(smollm2.folder, dtype=dtype, chunk=8,
                     speculative=drafting_always(replace(NGRAM, speculative_ngram_branches=3)))
    both = check_mixed_run(core, n=5)
    assert core.spec is not None and core.spec.drafted > 0, "drafts were verified"
    assert both.stacked >= 10
