"""``--dtype auto`` takes the checkpoint's dtype, except on a CPU where that dtype has no fast GEMM: float16 runs in
float32, and so does bfloat16 where oneDNN cannot pack it (no AVX-512 or AVX-NE-CONVERT: torch's bfloat16 GEMM
there was 4-6x slower than float32's at 64-512 rows). An explicit dtype is always kept."""
from __future__ import annotations

import pytest
import torch

from engine.models import loader

CPU = torch.device("cpu")


@pytest.mark.parametrize("packs", [True, False])
def test_a_bfloat16_checkpoint_runs_in_bfloat16_only_where_the_cpu_has_its_gemm(monkeypatch: pytest.MonkeyPatch,
                                                                                 packs: bool) -> None:
    monkeypatch.setattr(loader, "can_prepack", lambda device, dtype: packs)
    assert loader.resolve_dtype("auto", "bfloat16", CPU) == (torch.bfloat16 if packs else torch.float32)
    assert loader.resolve_dtype("bfloat16", "bfloat16", CPU) == torch.bfloat16  # asked for: kept
    assert loader.resolve_dtype("auto", "float32", CPU) == torch.float32


def test_float16_runs_in_float32_on_cpu_unless_asked_for() -> None:
    assert loader.resolve_dtype("auto", "float16", CPU) == torch.float32
    assert loader.resolve_dtype("float16", "float16", CPU) == torch.float16


def test_this_hosts_answer_follows_onednn() -> None:
    want = torch.bfloat16 if loader.can_prepack(CPU, torch.bfloat16) else torch.float32
    assert loader.resolve_dtype("auto", "torch.bfloat16", CPU) == want
