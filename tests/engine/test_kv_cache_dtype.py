"""--kv-cache-dtype: a float32 model over a bfloat16 KV pool keeps half the bytes per token, attends over the
rounded K/V everywhere (so chunked and unchunked prefill give the same tokens), stays close to the float32 cache,
and leaves no page behind; a PD pair whose cache dtypes differ is refused at the handshake's layout check."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kv_transfer.wire.errors import LayoutMismatchError
from kv_transfer.wire.layout import KVLayout

PROMPTS = [[5 + i, 17, 99, 3 * i + 40, 250, 7, 11 * i + 3, 64, 8, 300 + i, 21, 42, 13] for i in range(4)]


def _core(model_dir: Path, kv: str, chunk: int = 512) -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model_path=str(model_dir), dtype="float32"),
                                   CacheConfig(page_size=4, max_total_tokens=4096, kv_cache_dtype=kv),
                                   SchedulerConfig(chunked_prefill_size=chunk, max_prefill_tokens=chunk)))


def _run(core: EngineCore) -> list[list[int]]:
    reqs = [core.make_request(p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
                              detokenize=False) for p in PROMPTS]
    core.run_to_completion(reqs)
    return [r.output_ids for r in reqs]


def test_bfloat16_pool_under_float32_model(tiny_model_dir: Path) -> None:
    full, half = _core(tiny_model_dir, "auto"), _core(tiny_model_dir, "bfloat16")
    assert full.pool.data.dtype == torch.float32 and half.pool.data.dtype == torch.bfloat16
    assert half.model.embed_tokens.weight.dtype == torch.float32
    assert half.kv_shape.bytes_per_token * 2 == full.kv_shape.bytes_per_token
    idle = half.allocator.available
    out_half = _run(half)
    assert half.allocator.available + half.cache.evictable_size // 4 == idle  # only the radix cache holds pages
    half.check_integrity()
    # chunks of 3 tokens read the earlier chunks' K/V back from the bfloat16 pool: the same tokens as one chunk
    assert _run(_core(tiny_model_dir, "bfloat16", chunk=3)) == out_half
    # bfloat16 K/V moves a few greedy choices at most on this random model; most tokens agree with float32
    out_full = _run(full)
    same = sum(a == b for x, y in zip(out_full, out_half) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, out_full)), (out_full, out_half)


def test_pd_pair_with_different_cache_dtypes_is_refused(tiny_model_dir: Path) -> None:
    prefill, decode = (KVLayout.packed(**_core(tiny_model_dir, kv).pool.describe()) for kv in ("bfloat16", "auto"))
    assert prefill.dtype == "bfloat16" and decode.dtype == "float32"
    with pytest.raises(LayoutMismatchError, match="dtype: this side has bfloat16, the peer has float32"):
        prefill.check_compatible(decode)
