"""Every process on a host routes the same row counts through the few-rows kernel: the first to calibrate a key
measures (under a lock) and stores, the others read; a corrupt file is measured again, not trusted; a measurement
other processes disturbed is taken again before it is stored."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.models import row_calibration


def _calibrate_in_child(file: str, out) -> None:  # noqa: ANN001 - a multiprocessing queue
    measured = []

    def measure() -> frozenset[int]:  # slow enough that the children overlap; each would answer its own pid
        time.sleep(0.3)
        measured.append(1)
        return frozenset({os.getpid()})
    rows = row_calibration.cached_rows("k", measure, Path(file))
    out.put((sorted(rows), len(measured)))


def test_processes_calibrating_at_once_all_get_the_one_measurement(tmp_path: Path) -> None:
    file = tmp_path / "cal.json"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_calibrate_in_child, args=(str(file), out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(rows == results[0][0] for rows, _ in results), results
    # exactly one process measured (more than once if the others' start-up disturbed it)
    assert sum(1 for _, n in results if n) == 1, results
    assert not list(tmp_path.glob("*.tmp"))
    assert row_calibration.cached_rows("k", lambda: frozenset({42}), file) == frozenset(results[0][0])


def test_recalibrating_replaces_the_stored_rows(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    file = tmp_path / "cal.json"
    assert row_calibration.cached_rows("k", lambda: frozenset({1}), file) == {1}
    monkeypatch.setenv("SPLITSERVE_RECALIBRATE", "1")
    assert row_calibration.cached_rows("k", lambda: frozenset({2}), file) == {2}
    monkeypatch.delenv("SPLITSERVE_RECALIBRATE")
    assert row_calibration.cached_rows("k", lambda: frozenset({3}), file) == {2}


def test_a_failed_write_measures_once_and_leaves_no_temp_file(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    file, calls = tmp_path / "cal.json", []

    def full(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(row_calibration.os, "replace", full)
    assert row_calibration.cached_rows("k", lambda: calls.append(1) or frozenset({4}), file) == {4}
    assert calls == [1] and not list(tmp_path.glob("*.tmp"))


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


def test_a_measurement_other_processes_disturbed_is_taken_again_before_it_is_stored(tmp_path: Path) -> None:
    file, calls = tmp_path / "cal.json", []
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass"

    def measure() -> frozenset[int]:
        calls.append(1)
        if len(calls) == 1:  # every core this process may use kept busy by others while it measures
            hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in os.sched_getaffinity(0)]
            try:
                time.sleep(1.0)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
        else:
            time.sleep(0.2)
        return frozenset({len(calls)})
    rows = row_calibration.cached_rows("k", measure, file)
    assert len(calls) >= 2 and rows != {1}, (calls, rows)
    assert row_calibration.cached_rows("k", lambda: frozenset({9}), file) == rows


def test_a_host_that_stays_busy_keeps_the_last_of_a_bounded_number_of_measurements(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(row_calibration, "QUIET_PAUSE_S", 0.0)
    calls = []

    def busy(measure):  # noqa: ANN001, ANN202 - every measurement reported disturbed
        return measure(), 0.9
    rows = row_calibration.measure_quietly(lambda: calls.append(1) or frozenset({len(calls)}), busy)
    assert len(calls) == row_calibration.QUIET_TRIES and rows == {row_calibration.QUIET_TRIES}
