"""Every process on a host routes the same row counts through the few-rows kernel: the first to calibrate a key
measures (under a lock) and stores, the others read; a corrupt file is measured again, not trusted."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from engine.models import row_calibration


def _calibrate_in_child(file: str, out) -> None:  # noqa: ANN001 - a multiprocessing queue
    # each process would measure something different (its pid decides), so agreement can only come from the file
    rows = row_calibration.cached_rows("k", lambda: frozenset({os.getpid() % 7 + 1, 9}), Path(file))
    out.put(sorted(rows))


def test_processes_calibrating_at_once_all_get_the_first_measurement(tmp_path: Path) -> None:
    file = tmp_path / "cal.json"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_calibrate_in_child, args=(str(file), out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(r == results[0] for r in results), results
    assert row_calibration.cached_rows("k", lambda: frozenset({42}), file) == frozenset(results[0])


def test_a_stored_key_is_not_measured_again_and_other_keys_are(tmp_path: Path) -> None:
    file = tmp_path / "cal.json"
    calls = []

    def measure(rows: set[int]):  # noqa: ANN202
        def run() -> frozenset[int]:
            calls.append(rows)
            return frozenset(rows)
        return run
    assert row_calibration.cached_rows("a", measure({1, 2}), file) == {1, 2}
    assert row_calibration.cached_rows("a", measure({3}), file) == {1, 2}
    assert row_calibration.cached_rows("b", measure({3}), file) == {3}
    assert calls == [{1, 2}, {3}]


def test_a_corrupt_file_is_measured_again(tmp_path: Path) -> None:
    file = tmp_path / "cal.json"
    file.write_text("{not json")
    assert row_calibration.cached_rows("a", lambda: frozenset({5}), file) == {5}
    assert row_calibration.cached_rows("a", lambda: frozenset({6}), file) == {5}


def test_the_key_names_the_shape_threads_kernel_and_cpu() -> None:
    k = row_calibration.key((1536, 576), "few_rows_gemm-abc")
    assert k.startswith("1536x576 ") and "kernel=few_rows_gemm-abc" in k and "threads=" in k and "cpu=" in k
    assert row_calibration.key((576, 1536), "few_rows_gemm-abc") != k
