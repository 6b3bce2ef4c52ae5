"""``--compare a.json b.json ...``: earlier results side by side (one table per phase, the first file is the
baseline each later column is divided by) and their curves on shared plots."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.serving.config import ConfigError
from benchmarks.serving.plots import latency_cdfs, load_curves
from benchmarks.serving.report import load_result, markdown_table, tag_as_phase


def _labels(results: list[dict[str, Any]], paths: list[str]) -> list[str]:
    labels = [r.get("label") or Path(p).stem for r, p in zip(results, paths)]
    if len(set(labels)) < len(labels):  # same label twice: tell them apart by file name
        labels = [f"{lab} ({Path(p).stem})" for lab, p in zip(labels, paths)]
    return labels


def compare_text(results: list[dict[str, Any]], labels: list[str]) -> str:
    parts = []
    most = max(len(r["phases"]) for r in results)
    for i in range(most):
        cols = [(lab, r["phases"][i]) for lab, r in zip(labels, results) if i < len(r["phases"])]
        names = sorted({ph["name"] for _, ph in cols})
        parts.append(f"### phase {i + 1}: {' / '.join(names)}\n\n" + markdown_table(cols, ratios=True))
        tags = set.intersection(*(set(ph.get("by_tag") or {}) for _, ph in cols))
        for tag in sorted(tags):  # e.g. the short chats of the interference workload, compared on their own
            tag_cols = [(lab, tag_as_phase(ph["by_tag"][tag])) for lab, ph in cols]
            parts.append(f"#### phase {i + 1}, tag {tag}\n\n" + markdown_table(tag_cols, ratios=True))
    workloads = {lab: (r.get("workload") or {}).get("name") for lab, r in zip(labels, results)}
    if len(set(workloads.values())) > 1:
        parts.append("note: the runs used different workloads: " + ", ".join(f"{k}={v}" for k, v in
                                                                             workloads.items()))
    return "\n\n".join(parts)


def run_compare(paths: list[str], out: str, plots: bool = True) -> tuple[str, list[Path]]:
    """The side-by-side text and the plot files written (none when ``plots`` is off)."""
    if len(paths) < 1:
        raise ConfigError("--compare needs at least one result JSON")
    results = [load_result(p) for p in paths]
    labels = _labels(results, paths)
    text = compare_text(results, labels)
    written: list[Path] = []
    if plots:
        runs = list(zip(labels, results))
        curves = Path(out)
        written.append(load_curves(runs, curves))
        written.append(latency_cdfs(runs, curves.with_name(curves.stem + "-cdf.png")))
    return text, written
