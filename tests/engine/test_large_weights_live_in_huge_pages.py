"""A CPU engine keeps its large weights in memory advised MADV_HUGEPAGE (engine/mem/huge_pages.py: a batch-1 decode
step streams every weight, and 4 KiB pages cost it a TLB miss every 4 KiB), moved there without changing a value;
``--huge-pages off`` leaves them where torch put them. Checked on the kernel's own account of each
mapping (``/proc/self/smaps``: ``hg`` among a mapping's VmFlags), not on whether it could find free huge pages."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.mem.huge_pages import MIN_BYTES, WeightArena, move_weights_to_huge_pages, thp_mode
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(sys.platform != "linux" or thp_mode() not in ("always", "madvise"),
                                reason="transparent huge pages are Linux's, and off on this host")


def advised(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised MADV_HUGEPAGE."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def big_weights(core: EngineCore) -> list[torch.Tensor]:
    return [p for p in core.model.parameters() if p.numel() * p.element_size() >= MIN_BYTES]


def greedy(core: EngineCore, prompt: list[int]) -> list[int]:
    req = core.make_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                            detokenize=False)
    core.add_request(req)
    while not req.finished:
        core.step()
    return req.output_ids


def core_with(model_dir: Path, huge_pages: str) -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model_path=str(model_dir), dtype="float32", huge_pages=huge_pages),
                                   CacheConfig(max_total_tokens=100_000), SchedulerConfig()))


def test_large_weights_are_advised_and_the_outputs_are_unchanged(tiny_model_dir: Path) -> None:
    on, off = core_with(tiny_model_dir, "auto"), core_with(tiny_model_dir, "off")
    weights = big_weights(on)
    assert weights, "the tiny model has no weight of a MiB: the test checks nothing"
    assert all(advised(w.data_ptr()) for w in weights)
    assert all(torch.equal(a, b) for a, b in zip(on.model.state_dict().values(), off.model.state_dict().values()))
    prompt = list(range(5, 40))
    assert greedy(on, prompt) == greedy(off, prompt)


def test_the_huge_pages_setting_off_moves_nothing(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = move_weights_to_huge_pages
    monkeypatch.setattr("engine.models.loader.move_weights_to_huge_pages",
                        lambda model: calls.append("move") or real(model))
    off = core_with(tiny_model_dir, "off")
    assert calls == [] and not any(advised(w.data_ptr()) for w in big_weights(off))
    core_with(tiny_model_dir, "auto")
    assert calls == ["move"]


def test_moved_weights_keep_their_values_and_tied_weights_move_once() -> None:
    emb = torch.nn.Embedding(1024, 512)  # 2 MiB
    head = torch.nn.Linear(512, 1024, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's LM head is
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": torch.nn.LayerNorm(512)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert move_weights_to_huge_pages(model) == 1024 * 512 * 4  # once, and the small norm stays
    assert model["head"].weight is model["emb"].weight and advised(model["emb"].weight.data_ptr())
    assert not advised(model["norm"].weight.data_ptr())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_arena_places_each_weight_on_a_64_byte_boundary_from_a_huge_page_start() -> None:
    arena = WeightArena(3 * (2 << 20))
    a = arena.copy(torch.ones(1000, dtype=torch.bfloat16))
    b = arena.copy(torch.full((7, 3), 2.0))
    assert a.data_ptr() % (2 << 20) == 0 and b.data_ptr() % 64 == 0 and b.data_ptr() >= a.data_ptr() + 2000
    assert (a == 1).all() and (b == 2).all()
