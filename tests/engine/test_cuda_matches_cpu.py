"""On a CUDA device the torch backend gives the CPU's greedy tokens (run only where CUDA exists)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams


@pytest.mark.gpu
def test_cuda_greedy_equals_cpu(tiny_model_dir: Path) -> None:
    outputs = {}
    for device in ("cpu", "cuda"):
        core = EngineCore(EngineConfig(ModelConfig(model_path=str(tiny_model_dir), device=device, dtype="float32"),
                                       CacheConfig(page_size=16, max_total_tokens=8192),
                                       SchedulerConfig(chunked_prefill_size=32)))
        prompts = [list(range(10, 10 + n)) for n in (3, 40, 100)]
        reqs = [core.make_request(p, SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True),
                                  detokenize=False) for p in prompts]
        core.run_to_completion(reqs)
        core.check_integrity()
        outputs[device] = [r.output_ids for r in reqs]
    assert outputs["cuda"] == outputs["cpu"]
