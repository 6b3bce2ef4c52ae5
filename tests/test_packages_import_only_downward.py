"""The folder list is the architecture diagram: each top-level package imports only the packages below it. The
engine knows no role, no transfer, no launcher; the roles meet only over the wire (neither imports the other);
the ``splitserve`` command sits above everything. Checked on every import statement of every module (function-local
imports included), so a new upward arrow fails here, naming the file."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

BELOW: dict[str, set[str]] = {
    "configflags": set(),
    "router": set(),
    "frontend": set(),  # programs over HTTP: no engine, no torch
    "engine": {"configflags"},
    "kv_transfer": {"configflags"},
    "prefill_worker": {"configflags", "engine", "kv_transfer"},
    "decode_worker": {"configflags", "engine", "kv_transfer"},
    "deploy": {"configflags", "engine", "kv_transfer", "router"},
    "benchmarks": {"configflags", "engine", "kv_transfer", "router", "deploy", "frontend"},
    "splitserve": {"configflags", "engine", "kv_transfer", "router", "deploy", "benchmarks", "prefill_worker",
                   "decode_worker", "frontend"},
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(BELOW)


def test_every_package_imports_only_downward() -> None:
    wrong = []
    for pkg, allowed in BELOW.items():
        files = sorted((REPO / pkg).rglob("*.py"))
        assert files, f"package {pkg} has no modules (renamed? update BELOW)"
        for f in files:
            for target in imported_packages(f) - allowed - {pkg}:
                wrong.append(f"{f.relative_to(REPO)} imports {target}")
    assert not wrong, "imports that run upward or sideways:\n" + "\n".join(wrong)


def test_every_top_level_package_has_a_place_in_the_diagram() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages == set(BELOW), packages ^ set(BELOW)
