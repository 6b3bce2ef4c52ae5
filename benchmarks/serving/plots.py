"""PNG plots of one or more results: latency CDFs (TTFT, ITL, TPOT, E2E; one line per run and phase) and
throughput, goodput and latency against the offered load (request rate, or concurrency when the rate is inf)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Run = tuple[str, dict[str, Any]]  # (label, result JSON)
LINESTYLES = ("-", "--", ":", "-.")
CDF_PANELS = (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))


def _values(phase: dict[str, Any], key: str) -> list[float]:
    out: list[float] = []
    for r in phase.get("requests") or []:
        if not r.get("ok"):
            continue
        v = r.get(key)
        if isinstance(v, list):
            out.extend(x * 1000 for x in v)
        elif isinstance(v, (int, float)):
            out.append(v * 1000)
    return sorted(out)


def latency_cdfs(runs: list[Run], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    drawn = 0
    for ax, (key, title) in zip(axes.flat, CDF_PANELS):
        for i, (label, result) in enumerate(runs):
            for j, phase in enumerate(result["phases"]):
                v = _values(phase, key)
                if not v:
                    continue
                y = [(k + 1) / len(v) for k in range(len(v))]
                # one run: a colour per phase; several: a colour per run, a line style per phase
                style = {"color": f"C{j % 10}"} if len(runs) == 1 else {
                    "color": f"C{i % 10}", "linestyle": LINESTYLES[j % len(LINESTYLES)]}
                name = phase["name"] if len(runs) == 1 else f"{label} {phase['name']}"
                ax.step(v, y, where="post", label=name, **style)
                drawn += 1
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if not drawn:
        fig.text(0.5, 0.5, "no per-request timings (run without --no-save-requests)", ha="center")
    fig.suptitle(" vs ".join(label for label, _ in runs))
    fig.tight_layout()
    return _save(fig, path)


def load_axis(phases: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """The x axis: finite rates when every phase has one, else concurrency when set, else the phase index."""
    rates = [float(p["request_rate"]) for p in phases]
    if all(math.isfinite(r) for r in rates):
        return "offered request rate (req/s)", rates
    conc = [p.get("max_concurrency") for p in phases]
    if all(isinstance(c, int) for c in conc):
        return "max concurrency", [float(c) for c in conc]  # type: ignore[arg-type]
    return "phase", [float(i) for i in range(len(phases))]


def _lat(phase: dict[str, Any], key: str, stat: str) -> float:
    v = (phase.get(key) or {}).get(stat)
    return float(v) if v is not None else math.nan


def load_curves(runs: list[Run], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    xlabel = ""
    for i, (label, result) in enumerate(runs):
        phases = result["phases"]
        xlabel, x = load_axis(phases)
        color = f"C{i % 10}"
        axes[0, 0].plot(x, [p["request_throughput"] for p in phases], "o-", color=color, label=f"{label} throughput")
        good = [(p.get("goodput") or {}).get("request_rate") for p in phases]
        if any(g is not None for g in good):
            axes[0, 0].plot(x, [g if g is not None else math.nan for g in good], "s--", color=color,
                            label=f"{label} goodput")
        axes[0, 1].plot(x, [p["output_token_throughput"] for p in phases], "o-", color=color, label=label)
        for ax, key in ((axes[1, 0], "ttft_ms"), (axes[1, 1], "tpot_ms")):
            ax.plot(x, [_lat(p, key, "p50") for p in phases], "o-", color=color, label=f"{label} p50")
            ax.plot(x, [_lat(p, key, "p99") for p in phases], "^:", color=color, label=f"{label} p99")
    titles = ("requests/s (solid) and goodput (dashed)", "output tokens/s", "TTFT (ms)", "TPOT (ms)")
    for ax, title in zip(axes.flat, titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_paths(json_path: Path) -> tuple[Path, Path]:
    stem = json_path.with_suffix("")
    return Path(f"{stem}-latency-cdf.png"), Path(f"{stem}-load.png")


def write_plots(runs: list[Run], json_path: Path) -> list[Path]:
    cdf, load = plot_paths(json_path)
    return [latency_cdfs(runs, cdf), load_curves(runs, load)]
