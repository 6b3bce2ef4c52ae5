"""A native kernel's compiled library is keyed by the headers beside its source as well as the shared ones
(engine/native.py): few_rows_gemm.c includes the output-lanes GEMM from lanes_gemm.h beside it, and a library cached
under the source's text alone would keep serving the old GEMM after that header changed. The A/B helper that
builds a kernel as it was at a git revision (bench_decode_ab's ``--gemm-base``) brings that revision's headers
along too."""
from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.bench_decode_ab import source_at
from engine import native
from engine.models import cpu_gemm

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler here")


def test_a_header_beside_the_source_is_part_of_the_cache_key(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "answer.c"
    source.write_text('#include "answer.h"\nint splitserve_answer(void) { return ANSWER; }\n')
    answers = []
    for value in (41, 42):
        (tmp_path / "answer.h").write_text(f"#define ANSWER {value}\n")
        monkeypatch.setattr(native, "_loaded", {})  # a new process, as far as native.load knows
        lib = native.load(source)
        assert lib is not None
        answers.append(lib.splitserve_answer())
    assert answers == [41, 42]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the kernel's bodies are x86")
def test_a_kernel_at_a_revision_builds_with_the_headers_beside_its_source() -> None:
    now = cpu_gemm.few_rows_kernel()
    assert now is not None
    base = source_at("HEAD", "engine/models/few_rows_gemm.c", now)
    assert isinstance(base, ctypes.CDLL)
    if cpu_gemm.lanes_rows_max(now, torch.float32) == 0 or cpu_gemm.lanes_rows_max(base, torch.float32) == 0:
        pytest.skip("no output-lanes GEMM on this CPU")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(7, 64, generator=g)
    packed = cpu_gemm.lanes_pack(w)
    torch.testing.assert_close(cpu_gemm.lanes_gemm(base, x, packed, 96, None), x @ w.T, rtol=1e-5, atol=1e-5)
