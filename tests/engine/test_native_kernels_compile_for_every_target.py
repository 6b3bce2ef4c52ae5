"""Every native kernel compiles for the CPU families it has bodies for, not only for the one running the suite: a
suite on an AVX2 host never builds the AVX-512 code, and a kernel that does not compile is not used at all (native.py
falls back to pure torch), so an AVX-512 host would lose it silently (an AVX-512 body that used a macro of the AVX2
one's did, until this test). Compiled (not run) with native.py's flags for AVX without FMA (the generic bodies),
AVX2 with FMA, AVX-512, and AVX-512 with BF16, on hosts with an x86 compiler. (Without AVX, vec16.h's 32-byte
vectors fit no register its asm constraints name: such CPUs take the pure-torch path.)"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import native

ENGINE = Path(native.__file__).parent
SOURCES = sorted(ENGINE.rglob("*.c"))
TARGETS = ["sandybridge", "haswell", "skylake-avx512", "sapphirerapids"]
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="no C compiler for x86 here")


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_for_the_target(target: str, tmp_path: Path) -> None:
    assert SOURCES and any(s.name == "few_rows_gemm.c" for s in SOURCES)
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-O3", "-shared")]
    failed = {}
    for source in SOURCES:
        proc = subprocess.run([CC, "-O1", f"-march={target}", *flags, f"-I{ENGINE}", "-c", str(source), "-o",
                               str(tmp_path / f"{source.stem}.o")], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            failed[source.name] = proc.stderr[-1500:]
    assert not failed, failed
