"""Every worker command line the chart renders is accepted by the real worker programs: each is run here (pod-only
references such as $(POD_IP) filled in, the model path pointed at a folder that does not exist) and must get past
argument parsing to model loading, where it stops with the model error instead of argparse's usage error."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deploy.chart import CHART, container, find, render
from tests.helpers import REPO

MISSING_MODEL = "/nonexistent/splitserve-chart-check"
POD_REFS = {"$(POD_IP)": "127.0.0.1", "$(POD_NAME)": "rel-splitserve-prefill-0"}


def local_argv(c: dict) -> list[str]:
    args = list(c["args"])
    for ref, value in POD_REFS.items():
        args = [a.replace(ref, value) for a in args]
    assert not any("$(" in a for a in args), f"unresolved reference in {args}"
    # The last --model-path wins in argparse: parsing covers every rendered flag, loading fails at once.
    return [sys.executable, *c["command"][1:], *args, f"--model-path={MISSING_MODEL}"]


@pytest.mark.parametrize("values", [None, CHART / "ci" / "pd-at-scale-values.yaml",
                                    CHART / "ci" / "hostpath-values.yaml"], ids=["default", "pd-at-scale", "hostpath"])
def test_worker_command_lines_parse(values) -> None:
    docs = render(values)
    procs = {}
    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", f"-{role}"), role)
        assert c["command"][:2] == ["python", "-m"] and c["command"][2] == f"{role}_worker"
        procs[role] = subprocess.Popen(local_argv(c), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    for role, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert "unrecognized arguments" not in out and "usage:" not in out, f"{role}: {out[-2000:]}"
        # status 2 is argparse's too: the message tells the model error (past parsing) from a usage error
        assert proc.returncode == 2 and f"--model-path {MISSING_MODEL}: no such file or folder" in out, \
            f"{role}: {out[-2000:]}"
