"""HiCache's shared tier (L3, the file backend): a second engine pointed at the same directory serves the
prefixes the first computed from the store, with the tokens a cold engine gives; namespaces (``extra_key``)
and other models never share entries; a corrupt entry, or a store that cannot be used at all, only costs
recomputation: every request still succeeds with the same tokens, and the counters say what happened."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfigError
from engine.mem.storage import chain_keys, model_fingerprint, seal, unseal
from tests.engine.conftest import make_core, run_each as run

SYSTEM, TENANTS = 64, 3


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(10, 4000) for _ in range(SYSTEM + 6)] for _ in range(TENANTS)]



def stored(tmp_path: Path) -> CacheConfig:
    return CacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path / "store"))


def test_a_second_engine_reads_what_the_first_stored(tiny_model_dir: Path, tmp_path: Path) -> None:
    cold, _ = run(make_core(tiny_model_dir, page_size=4), prompts())
    first = make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path))
    outs, cached = run(first, prompts())
    assert outs == cold and cached == [0] * TENANTS and first.hicache.counters()["stored_tokens"] >= TENANTS * SYSTEM
    second = make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path))
    outs, cached = run(second, prompts())
    assert outs == cold
    assert all(c >= SYSTEM for c in cached), cached  # whole pages of the prompt (its last token is computed)
    assert second.hicache.stats.store_loaded_tokens == sum(cached)
    # another namespace shares nothing
    outs, cached = run(make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path)), prompts(), "tenant-x")
    assert outs == cold and cached == [0] * TENANTS
    # nor does another KV layout (bfloat16 KV)
    _, cached = run(make_core(tiny_model_dir, page_size=4, dtype="bfloat16", hicache=stored(tmp_path)), prompts())
    assert cached == [0] * TENANTS


def test_another_checkpoint_gets_another_fingerprint(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 4096)
    before = model_fingerprint(config, [weights])
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # a fine-tune: same size, same config, other weights
    weights.write_bytes(bytes(data))
    assert model_fingerprint(config, [weights]) != before


def test_a_corrupt_entry_or_an_unusable_store_only_costs_recomputation(tiny_model_dir: Path, tmp_path: Path) -> None:
    cold, _ = run(make_core(tiny_model_dir, page_size=4), prompts())
    run(make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path)), prompts())
    files = sorted(p for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert files
    for f in files[::3]:  # flip a byte in every third entry
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    core = make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path))
    outs, _ = run(core, prompts())
    assert outs == cold and core.hicache.stats.store_misses > 0
    # a bad entry is replaced by the recomputed page (a prompt heals its first bad entry per pass, since the
    # ones after it are not read): within a few passes every prefix comes back whole
    for _ in range(8):
        healed = make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path))
        outs, cached = run(healed, prompts())
        assert outs == cold
        if healed.hicache.stats.store_misses == 0:
            break
    assert healed.hicache.stats.store_misses == 0 and all(c >= SYSTEM for c in cached)
    core = make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path))
    shutil.rmtree(tmp_path / "store")
    (tmp_path / "store").write_text("not a directory")  # gone mid-run: every lookup, read and write fails
    outs, cached = run(core, prompts())
    assert outs == cold and cached == [0] * TENANTS and core.hicache.counters()["store_failures"] > 0
    with pytest.raises(EngineConfigError, match="--hicache-storage-dir"):  # refused at start-up, though
        make_core(tiny_model_dir, page_size=4, hicache=stored(tmp_path / "store"))


def test_keys_chain_whole_prefixes_and_a_sealed_entry_detects_corruption() -> None:
    a = chain_keys(b"model", [1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_keys(b"model", [1, 2, 9, 4], 2)[1] != a[1]  # same page, different prefix: another key
    assert chain_keys(b"other", [1, 2], 2)[0] != a[0]
    entry = seal(b"kv-bytes")
    assert unseal(entry, 8) == b"kv-bytes" and unseal(entry[:-1], 8) is None
    assert unseal(entry[:3] + b"X" + entry[4:], 8) is None and unseal(None, 8) is None
