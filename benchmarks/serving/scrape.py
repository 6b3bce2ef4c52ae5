"""The target's Prometheus metrics, scraped before and after a phase. Everything under the prefix is kept
(histogram buckets aside); counters are reported as deltas, gauges as their value after the phase. Prefix-cache
hit rate and KV transfer totals are derived when those metrics exist (KV transfer only on PD workers)."""
from __future__ import annotations

import re
import urllib.error
import urllib.request
from typing import Any

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_COUNTER_SUFFIXES = ("_total", "_sum", "_count")


def parse_prometheus(text: str, prefix: str) -> tuple[dict[str, float], set[str]]:
    """Series ``name{labels}`` -> value for metric names starting with ``prefix`` (no histogram buckets), and
    the names that count up (counters, histogram/summary ``_sum``/``_count``) by their ``# TYPE`` lines; a name
    without a TYPE line counts up when it ends in _total, _sum or _count."""
    out: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None or not m.group(1).startswith(prefix) or m.group(1).endswith("_bucket"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1) + (m.group(2) or "")] = value
    return out, {n for n in {k.split("{", 1)[0] for k in out} if _counts_up(n, types)}


def _counts_up(name: str, types: dict[str, str]) -> bool:
    for suffix in ("", *_COUNTER_SUFFIXES):
        if suffix and not name.endswith(suffix):
            continue
        kind = types.get(name[: len(name) - len(suffix)] if suffix else name)
        if kind is not None:
            return kind == "counter" or (kind in ("histogram", "summary") and suffix in ("_sum", "_count"))
    return name.endswith(_COUNTER_SUFFIXES)


# No proxies: the scrapes go exactly where the user pointed them, whatever http_proxy says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch_text(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> str:
    """GET ``url`` directly (never through a proxy) and return the body as text."""
    with _OPENER.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return resp.read().decode("utf-8", "replace")


def scrape(urls: list[str], prefix: str, headers: dict[str, str] | None = None, timeout: float = 10.0
           ) -> dict[str, Any]:
    """One scrape of every URL; a URL that fails is recorded with its error, never fatal."""
    result: dict[str, Any] = {}
    for url in urls:
        try:
            text = fetch_text(url, headers, timeout)
            series, counters = parse_prometheus(text, prefix)
            result[url] = {"ok": True, "error": None, "series": series, "counters": sorted(counters)}
        except (urllib.error.URLError, OSError, ValueError) as e:
            result[url] = {"ok": False, "error": f"{type(e).__name__}: {e}", "series": {}, "counters": []}
    return result


def _by_name(snapshot: dict[str, Any]) -> dict[str, float]:
    """Sum each metric over its label sets and over all URLs."""
    totals: dict[str, float] = {}
    for entry in snapshot.values():
        for series, value in entry["series"].items():
            name = series.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _per_url_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Counter deltas of each URL on its own (how the work spread over a cluster's workers)."""
    out: dict[str, dict[str, float]] = {}
    for url, entry in after.items():
        if not entry["ok"] or not before.get(url, {}).get("ok"):
            continue
        a, b = _by_name({url: entry}), _by_name({url: before[url]})
        out[url] = {n: a[n] - b.get(n, 0.0) for n in sorted(a) if n in set(entry["counters"])}
    return out


def summarize(before: dict[str, Any], after: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Deltas of counters, values of gauges, and the derived numbers, for the phase between two scrapes."""
    b, a = _by_name(before), _by_name(after)
    counters = {n for snap in (before, after) for e in snap.values() for n in e["counters"]}
    delta = {n: a[n] - b.get(n, 0.0) for n in sorted(a) if n in counters}
    gauges = {n: a[n] for n in sorted(a) if n not in counters}
    prompt = delta.get(f"{prefix}prompt_tokens_total")
    cached = delta.get(f"{prefix}cached_prompt_tokens_total")
    hit_rate = cached / prompt if prompt and cached is not None else None
    kv = {n: v for n, v in delta.items() if "kv_transfer" in n}
    errors = {u: e["error"] for u, e in after.items() if not e["ok"]}
    errors.update({u: e["error"] for u, e in before.items() if not e["ok"]})
    return {
        "urls": sorted(set(before) | set(after)),
        "scrape_errors": errors,
        "counter_deltas": delta,
        "counter_deltas_by_url": _per_url_deltas(before, after),
        "gauges_after": gauges,
        "prefix_cache_hit_rate": hit_rate,
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "generation_tokens": delta.get(f"{prefix}generation_tokens_total"),
        "kv_transfer": kv,
        "kv_transfer_bytes": delta.get(f"{prefix}kv_transfer_bytes_total"),
    }
