"""The result JSON (what ran, where, on what, and every phase's numbers) and the markdown tables printed for a
run or a comparison."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.serving.config import BenchConfig, ConfigError

SCHEMA = "splitserve.bench_serving/1"
TOP_LEVEL_FIELDS = ("schema", "label", "command", "config", "target", "workload", "versions", "machine",
                    "started_at", "finished_at", "duration_s", "phases", "plots")
REPO = Path(__file__).resolve().parent.parent.parent


def jsonable(x: Any) -> Any:
    """Plain JSON: infinities and NaN become the strings "inf"/"-inf"/"nan" (strict parsers reject them)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("splitserve", "aiohttp", "matplotlib", "tqdm", "tokenizers", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        out["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        out["git_dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        out["git_commit"], out["git_dirty"] = None, None
    return out


def machine() -> dict[str, Any]:
    """The machine the load generator ran on (the target's own is in target.server_info when it says)."""
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"hostname": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "memory_bytes": mem, "load_average": load,
            "python_executable": sys.executable}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


REDACTED = "<redacted>"


def redact_argv(argv: list[str]) -> list[str]:
    """The command line without the API key's value (``--api-key KEY`` or ``--api-key=KEY``)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--api-key":
            out.append(REDACTED)
        elif arg.startswith("--api-key="):
            out.append("--api-key=" + REDACTED)
        else:
            out.append(arg)
    return out


def build_result(cfg: BenchConfig, argv: list[str], target: dict[str, Any], workload: dict[str, Any],
                 phases: list[dict[str, Any]], started_at: str, duration: float) -> dict[str, Any]:
    config = dataclasses.asdict(cfg)
    if config["target"]["api_key"]:
        config["target"]["api_key"] = REDACTED
    return jsonable({
        "schema": SCHEMA, "label": cfg.label, "command": redact_argv(argv), "config": config,
        "target": target, "workload": workload, "versions": versions(), "machine": machine(),
        "started_at": started_at, "finished_at": now_iso(), "duration_s": duration, "phases": phases,
        "plots": [],
    })


def default_output(label: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("bench_results") / f"{label}-{stamp}.json"


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such result file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not JSON ({e.msg}); pass result files written by bench_serving") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ConfigError(f"{p}: not a bench_serving result (schema {SCHEMA!r} expected)")
    return data


# (row label, getter) for the tables; a getter returns a number or None.
def _lat(key: str, stat: str) -> Any:
    return lambda ph: (ph.get(key) or {}).get(stat)


ROWS: list[tuple[str, Any]] = [
    ("completed / failed", lambda ph: f"{ph['completed']} / {ph['failed']}"),
    ("request throughput (req/s)", lambda ph: ph["request_throughput"]),
    ("output throughput (tok/s)", lambda ph: ph["output_token_throughput"]),
    ("total throughput (tok/s)", lambda ph: ph["total_token_throughput"]),
    ("goodput (req/s)", lambda ph: (ph.get("goodput") or {}).get("request_rate")),
    ("goodput fraction", lambda ph: (ph.get("goodput") or {}).get("fraction")),
    ("TTFT p50 (ms)", _lat("ttft_ms", "p50")), ("TTFT p90 (ms)", _lat("ttft_ms", "p90")),
    ("TTFT p99 (ms)", _lat("ttft_ms", "p99")),
    ("ITL p50 (ms)", _lat("itl_ms", "p50")), ("ITL p99 (ms)", _lat("itl_ms", "p99")),
    ("ITL max (ms)", _lat("itl_ms", "max")),
    ("TPOT p50 (ms)", _lat("tpot_ms", "p50")), ("TPOT p99 (ms)", _lat("tpot_ms", "p99")),
    ("E2E p50 (ms)", _lat("e2e_ms", "p50")), ("E2E p99 (ms)", _lat("e2e_ms", "p99")),
    ("prefix cache hit rate (server)", lambda ph: (ph.get("server_metrics") or {}).get("prefix_cache_hit_rate")),
    ("cached tokens (usage)", lambda ph: ph.get("total_cached_tokens")),
    ("KV transfer bytes", lambda ph: (ph.get("server_metrics") or {}).get("kv_transfer_bytes")),
]


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def markdown_table(columns: list[tuple[str, dict[str, Any]]], ratios: bool = False) -> str:
    """Rows are metrics, columns are phases or runs; with ``ratios`` each later column also shows x/first."""
    head = ["metric"] + [name for name, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, get in ROWS:
        values = [get(ph) for _, ph in columns]
        if all(v is None for v in values):
            continue
        cells = []
        for i, v in enumerate(values):
            cell = _fmt(v)
            base = values[0]
            if ratios and i > 0 and isinstance(v, (int, float)) and isinstance(base, (int, float)) and base:
                cell += f" ({v / base:.2f}x)"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tag_as_phase(tag_summary: dict[str, Any]) -> dict[str, Any]:
    """A by_tag entry shaped like a phase for the tables (throughputs belong to the phase, not a tag)."""
    return {**tag_summary, "request_throughput": None, "output_token_throughput": None,
            "total_token_throughput": None, "goodput": {"fraction": tag_summary.get("goodput_fraction")}}


def by_tag_table(phase: dict[str, Any]) -> str | None:
    tags = phase.get("by_tag")
    if not tags:
        return None
    return markdown_table([(f"tag {t}", tag_as_phase(v)) for t, v in tags.items()])
