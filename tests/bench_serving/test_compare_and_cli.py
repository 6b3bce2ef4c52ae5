"""--compare puts earlier results side by side (ratios to the first) and plots them together; the tool is also
``splitserve bench``; bad input gets a clear error, not a traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import pytest

from benchmarks.bench_serving import main as bench_main
from splitserve.cli import main as splitserve_main
from tests.helpers import REPO

ARGS = ("--num-prompts", "3", "--input-len", "4", "--output-len", "3", "--warmup-requests", "0")


def test_compare_prints_side_by_side_with_ratios_and_plots_together(fault_server, run_bench, tmp_path, capsys):
    fast, slow = fault_server(ttft_ms=20, itl_ms=5), fault_server(ttft_ms=120, itl_ms=5)
    sweep = ("--workload", "interference", "--long-every", "3", "--long-prompt-len", "8", "--long-output-len", "2",
             "--request-rate", "50", "inf", "--arrival", "constant")
    run_bench(fast.url, *ARGS, *sweep, "--label", "fast")
    run_bench(slow.url, *ARGS, *sweep, "--label", "slow")
    capsys.readouterr()
    out = tmp_path / "cmp.png"
    a, b = (str(p) for p in run_bench.paths)
    assert bench_main(["--compare", a, b, "--compare-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| metric | fast | slow |" in text
    assert "### phase 1: rate=50" in text and "### phase 2: rate=inf" in text
    ttft_row = next(line for line in text.splitlines() if line.startswith("| TTFT p50 (ms)"))
    ratio = float(ttft_row.split("(")[-1].split("x)")[0])
    assert ratio > 2  # 120 ms against 20 ms injected
    assert "#### phase 1, tag long" in text and "#### phase 2, tag short" in text  # each class on its own too
    for png in (out, tmp_path / "cmp-cdf.png"):
        assert matplotlib.image.imread(png).shape[0] > 100


def test_compare_refuses_files_that_are_not_results(tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit) as exc:
        bench_main(["--compare", str(junk)])
    assert exc.value.code == 2
    assert "not a bench_serving result" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--compare", str(tmp_path / "missing.json")])
    assert "no such result file" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [
    (["--base-url", "localhost:30000"], "--base-url must look like http://HOST:PORT"),
    (["--workload", "jsonl"], "--dataset-path"),
    (["--length-dist", "uniform", "--length-spread", "1.5"], "--length-spread"),
    (["--request-timeout", "-1"], "--request-timeout"),
])
def test_bad_flags_get_a_message_that_names_the_fix(bad, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(bad)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_splitserve_bench_delegates_to_the_tool(fault_server, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        splitserve_main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--slo-ttft-ms" in capsys.readouterr().out
    srv = fault_server()
    out = tmp_path / "r.json"
    splitserve_main(["bench", "--base-url", srv.url, *ARGS, "--no-progress", "--no-plots", "--output", str(out)])
    assert json.loads(out.read_text())["phases"][0]["completed"] == 3


def test_splitserve_help_lists_both_subcommands():
    res = subprocess.run([sys.executable, "-m", "splitserve", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    assert "tiny-model" in res.stdout and "bench" in res.stdout


def test_a_progress_bar_shows_while_running(fault_server, tmp_path, capsys):
    srv = fault_server(itl_ms=5)
    bench_main(["--base-url", srv.url, *ARGS, "--no-plots", "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert "rate=inf" in err and "3/3" in err


def test_a_tokenizer_that_cannot_be_loaded_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    for path in (bad, tmp_path / "missing"):
        with pytest.raises(SystemExit) as exc:
            bench_main(["--tokenizer", str(path), "--no-progress"])
        assert exc.value.code == 2
        assert f"--tokenizer {path}" in capsys.readouterr().err
