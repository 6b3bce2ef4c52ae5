"""Our model equals transformers' reference implementation on the same checkpoint (float32, max abs diff
<= 1e-4 at every sampled position), for Llama (plain, Llama 3 RoPE scaling, tied + sharded), Qwen2 and Qwen3,
over a batch of mixed-length prompts run with chunked prefill, prompts whose prefix comes from the radix cache,
and 64 greedy tokens that must equal ``model.generate``."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.engine_core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core
from tests.helpers import check_against_reference, record_logits, write_hf_checkpoint

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3-rope": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-tied-sharded": dict(arch="llama", tie=True, shard=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
}
TOL = 1e-4
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tiny_model_dir: Path) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param],
                               tokenizer_from=tiny_model_dir)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # never stop early: compare exactly NEW_TOKENS tokens
    return model.eval()


def greedy(core: EngineCore, prompt: list[int], rid: str) -> Request:
    return core.make_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                             rid=rid, detokenize=False)


def test_mixed_batch_with_chunked_prefill_and_cached_prefixes(checkpoint: Path, reference) -> None:  # noqa: ANN001
    core = make_core(checkpoint, page_size=4, chunk=5, max_prefill_tokens=12)
    seen = record_logits(core)
    rng = random.Random(7)
    vocab = core.arch.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 23, 50)]
    first = [greedy(core, p, f"first-{i}") for i, p in enumerate(prompts)]
    core.run_to_completion(first)
    # Second wave: prompts extending the first wave's, so their prefix pages come from the radix cache.
    shared = [prompts[3][:40] + [rng.randrange(3, vocab) for _ in range(9)], prompts[2] + [5, 6, 7],
              prompts[3] + first[3].output_ids[:10]]
    second = [greedy(core, p, f"second-{i}") for i, p in enumerate(shared)]
    core.run_to_completion(second)
    assert all((r.cached_tokens or 0) >= 20 for r in second), [r.cached_tokens for r in second]
    for req in first + second:
        check_against_reference(reference, req, seen[req.rid], TOL)
    core.check_integrity()
