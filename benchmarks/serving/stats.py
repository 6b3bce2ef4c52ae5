"""Numbers of one phase from its request records: latency distributions (ms), throughput, SLO goodput, errors
by kind. Failed requests are counted, never dropped: they lower goodput and appear under ``errors``."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from benchmarks.serving.client import RequestRecord

MAX_TAGS = 16
ERROR_SAMPLES = 3


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft if r.ttft is not None else r.e2e), (self.tpot_ms, r.tpot),
                  (self.e2e_ms, r.e2e))
        # A request with a single output token has no TPOT; it cannot miss that SLO.
        return all(limit is None or value is None or value * 1000 <= limit for limit, value in checks)

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of an ascending list."""
    if not sorted_values:
        raise ValueError("percentile of nothing")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values_s: list[float]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max in milliseconds (None when there are no values)."""
    v = sorted(x * 1000 for x in values_s)
    if not v:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(v), "mean": sum(v) / len(v), "min": v[0], "p50": percentile(v, 50),
            "p90": percentile(v, 90), "p99": percentile(v, 99), "max": v[-1]}


def latencies(records: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    ok = [r for r in records if r.ok]
    return {"ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
            "itl_ms": distribution([x for r in ok for x in r.itl]),
            "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
            "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None])}


def _tokens(records: list[RequestRecord], attr: str) -> int:
    return sum(getattr(r, attr) or 0 for r in records if r.ok)


def summarize_phase(records: list[RequestRecord], duration: float, slo: SLO) -> dict[str, Any]:
    sent = [r for r in records if r.sent]
    ok = [r for r in sent if r.ok]
    failed = [r for r in sent if not r.ok]
    errors = Counter(r.error or "unknown" for r in failed)
    samples: dict[str, list[str]] = {}
    for r in failed:
        bucket = samples.setdefault(r.error or "unknown", [])
        if len(bucket) < ERROR_SAMPLES and r.error_message and r.error_message not in bucket:
            bucket.append(r.error_message)
    prompt, out, cached = _tokens(ok, "prompt_tokens"), _tokens(ok, "output_tokens"), _tokens(ok, "cached_tokens")
    dur = max(duration, 1e-9)
    good = sum(slo.met(r) for r in sent) if slo.active else None
    mismatched = sum(1 for r in ok if r.output_tokens is not None and r.output_tokens != r.planned_output)
    # ITL is timed between chunks; when a stream merges tokens (or skips tokens without text) there are fewer
    # gaps than tokens. 1.0 means one chunk per token; TPOT, from the server's counts, is exact either way.
    token_gaps = sum(max((r.output_tokens or 0) - 1, 0) for r in ok)
    itl_coverage = sum(len(r.itl) for r in ok) / token_gaps if token_gaps else None
    summary: dict[str, Any] = {
        "duration_s": duration,
        "requests_planned": len(records),
        "requests_sent": len(sent),
        "not_sent": len(records) - len(sent),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(sorted(errors.items())),
        "error_samples": samples,
        "request_throughput": len(ok) / dur,
        "input_token_throughput": prompt / dur,
        "output_token_throughput": out / dur,
        "total_token_throughput": (prompt + out) / dur,
        "total_input_tokens": prompt,
        "total_output_tokens": out,
        "total_cached_tokens": cached,
        "planned_output_tokens": sum(r.planned_output for r in ok),
        "output_len_mismatches": mismatched,
        "usage_cache_hit_rate": cached / prompt if prompt and any(r.cached_tokens is not None for r in ok)
        else None,
        "tokens_source": sorted({r.tokens_source for r in ok if r.tokens_source}),
        "itl_coverage": itl_coverage,
        "goodput": None if good is None else {
            "slo": slo.to_json(), "requests": good, "request_rate": good / dur,
            "fraction": good / len(sent) if sent else 0.0},
        **latencies(records),
    }
    tags = sorted({r.tag for r in records})
    if 1 < len(tags) <= MAX_TAGS:
        summary["by_tag"] = {t: _tag_summary([r for r in records if r.tag == t], slo) for t in tags}
    return summary


def _tag_summary(records: list[RequestRecord], slo: SLO) -> dict[str, Any]:
    sent = [r for r in records if r.sent]
    out: dict[str, Any] = {"completed": sum(r.ok for r in sent), "failed": sum(not r.ok for r in sent),
                           **latencies(records)}
    if slo.active:
        out["goodput_fraction"] = sum(slo.met(r) for r in sent) / len(sent) if sent else 0.0
    return out
