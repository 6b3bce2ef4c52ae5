"""The load test's configuration: one frozen dataclass per part (target, workload, load, output). The command
line is built from these (configflags), so each default lives here and nowhere else."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from urllib.parse import urlparse

from configflags import add_dataclass_args, dataclass_from_args

BACKENDS = ("completions", "chat", "generate")
WORKLOADS = ("random", "shared-prefix", "multi-turn", "interference", "jsonl")
LENGTH_DISTS = ("fixed", "uniform", "lognormal")
ARRIVALS = ("poisson", "constant", "burst")


class ConfigError(ValueError):
    """A flag value the tool cannot run with; the message names the flag and the fix."""


@dataclass(frozen=True)
class TargetConfig:
    """Where the traffic goes (and nowhere else)."""

    base_url: str = field(default="http://127.0.0.1:30000", metadata={
        "help": "the endpoint under test; all requests go here and only here"})
    backend: str = field(default="completions", metadata={
        "help": "API to drive: OpenAI /v1/completions, /v1/chat/completions, or SGLang-style /generate "
                "(always streamed, to time tokens)", "choices": BACKENDS})
    model: str | None = field(default=None, metadata={
        "help": "model name sent in requests; left out means the first id from GET /v1/models"})
    api_key: str | None = field(default=None, metadata={"help": "sent as 'Authorization: Bearer KEY'"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "Hugging Face tokenizer folder (or tokenizer.json) used to size prompts in tokens; left out means "
                "the target's /get_model_info model_path when that folder exists here, else prompts are sized "
                "in words"})
    metrics_url: list[str] | None = field(default=None, metadata={
        "help": "Prometheus endpoints scraped before and after each phase (several for a cluster's workers); "
                "default: BASE_URL/metrics"})
    metrics_prefix: str = field(default="splitserve_", metadata={
        "help": "only metrics whose name starts with this are recorded"})
    scrape_metrics: bool = field(default=True, metadata={"help": "scrape the metrics endpoints at all"})
    ignore_eos: bool = field(default=True, metadata={
        "help": "send ignore_eos so output lengths are exact (servers that ignore it stop early; the recorded "
                "lengths always come from the server's usage)"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature sent with every request"})
    request_timeout: float = field(default=300.0, metadata={"help": "seconds one request may take in total"})
    flush_cache: bool = field(default=True, metadata={
        "help": "POST BASE_URL/flush_cache before each phase so phases of a sweep start cold (a server without it "
                "is noted in the JSON, not fatal)"})

    def __post_init__(self) -> None:
        parsed = urlparse(self.base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"--base-url must look like http://HOST:PORT, got {self.base_url!r}")
        if self.request_timeout <= 0 or not math.isfinite(self.request_timeout):
            raise ConfigError("--request-timeout must be a positive number of seconds")

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def metrics_urls(self) -> list[str]:
        return list(self.metrics_url) if self.metrics_url else [self.base_url.rstrip("/") + "/metrics"]


@dataclass(frozen=True)
class WorkloadConfig:
    """What is sent: prompts and output lengths, all drawn from --seed."""

    workload: str = field(default="random", metadata={"help": "which workload to generate", "choices": WORKLOADS})
    seed: int = field(default=0, metadata={"help": "every random choice of the workload and arrivals"})
    num_prompts: int = field(default=100, metadata={
        "help": "items per phase (a multi-turn item is one conversation of --num-turns requests)"})
    input_len: int = field(default=256, metadata={
        "help": "prompt tokens (random), user-message tokens (multi-turn), short-chat tokens (interference)"})
    output_len: int = field(default=64, metadata={"help": "output tokens per request"})
    length_dist: str = field(default="fixed", metadata={
        "help": "how random lengths spread around --input-len/--output-len", "choices": LENGTH_DISTS})
    length_spread: float = field(default=0.5, metadata={
        "help": "uniform: +/- this fraction of the length; lognormal: sigma (the length is the median)"})
    num_groups: int = field(default=8, metadata={"help": "shared-prefix: distinct system prompts (tenants)"})
    prefix_len: int = field(default=512, metadata={"help": "shared-prefix: tokens in each system prompt"})
    suffix_len: int = field(default=64, metadata={"help": "shared-prefix: tokens in each distinct question"})
    zipf_alpha: float = field(default=1.0, metadata={
        "help": "shared-prefix: popularity skew of the groups (P(group k) ~ 1/k^alpha; 0 = uniform)"})
    num_turns: int = field(default=4, metadata={"help": "multi-turn: user turns per conversation"})
    long_prompt_len: int = field(default=2048, metadata={"help": "interference: tokens in each long prompt"})
    long_output_len: int = field(default=8, metadata={"help": "interference: output tokens of each long prompt"})
    long_every: int = field(default=10, metadata={"help": "interference: every Nth item is a long prompt"})
    dataset_path: str | None = field(default=None, metadata={
        "help": "jsonl: a file with one JSON object per line: {\"prompt\": str} or {\"messages\": [...]}, "
                "optionally \"output_len\" and \"tag\""})

    def __post_init__(self) -> None:
        positive = {"--num-prompts": self.num_prompts, "--input-len": self.input_len, "--output-len":
                    self.output_len, "--num-groups": self.num_groups, "--prefix-len": self.prefix_len,
                    "--suffix-len": self.suffix_len, "--num-turns": self.num_turns,
                    "--long-prompt-len": self.long_prompt_len, "--long-output-len": self.long_output_len,
                    "--long-every": self.long_every}
        for flag, value in positive.items():
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if self.length_spread < 0 or (self.length_dist == "uniform" and self.length_spread >= 1):
            raise ConfigError("--length-spread must be >= 0 (and < 1 for the uniform distribution)")
        if self.zipf_alpha < 0:
            raise ConfigError("--zipf-alpha must be >= 0")
        if self.workload == "jsonl" and not self.dataset_path:
            raise ConfigError("--workload jsonl needs --dataset-path FILE.jsonl")


@dataclass(frozen=True)
class LoadConfig:
    """When requests are sent, and the bounds every run keeps."""

    request_rate: list[float] = field(default_factory=lambda: [math.inf], metadata={
        "help": "items per second; several values make a sweep (one phase each); inf = all at once"})
    arrival: str = field(default="poisson", metadata={
        "help": "spacing at a finite rate: poisson (exponential gaps), constant, or burst (--burst-size at once)",
        "choices": ARRIVALS})
    burst_size: int = field(default=8, metadata={"help": "burst arrival: items sent together"})
    max_concurrency: list[int] | None = field(default=None, metadata={
        "help": "most items in flight (fixed concurrency with rate inf); several values make a sweep"})
    max_duration: float = field(default=600.0, metadata={
        "help": "seconds one phase may run; requests still in flight then are cut and counted as errors"})
    warmup_requests: int = field(default=1, metadata={"help": "requests sent and discarded before the first phase"})

    def __post_init__(self) -> None:
        if not self.request_rate or any(r <= 0 or math.isnan(r) for r in self.request_rate):
            raise ConfigError("--request-rate values must be positive (or inf)")
        if self.max_concurrency is not None and any(c < 1 for c in self.max_concurrency):
            raise ConfigError("--max-concurrency values must be at least 1")
        if not (0 < self.max_duration < math.inf):
            raise ConfigError("--max-duration must be a positive, finite number of seconds (every run is bounded)")
        if self.burst_size < 1 or self.warmup_requests < 0:
            raise ConfigError("--burst-size must be >= 1 and --warmup-requests >= 0")

    def phases(self) -> list[tuple[float, int | None]]:
        """(rate, concurrency) for every phase: each rate with each concurrency."""
        return [(r, c) for r in self.request_rate for c in (self.max_concurrency or [None])]


@dataclass(frozen=True)
class OutputConfig:
    """What is written and shown."""

    output: str | None = field(default=None, metadata={
        "help": "result JSON path; plots go next to it; default: bench_results/LABEL-TIME.json"})
    label: str | None = field(default=None, metadata={
        "help": "name of this run in tables and plots (default: BACKEND-WORKLOAD)"})
    plots: bool = field(default=True, metadata={"help": "write PNG plots next to the JSON"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar on stderr"})
    save_requests: bool = field(default=True, metadata={
        "help": "keep every request's timings in the JSON (needed for CDFs in --compare)"})
    slo_ttft_ms: float | None = field(default=None, metadata={"help": "goodput SLO on time to first token"})
    slo_tpot_ms: float | None = field(default=None, metadata={"help": "goodput SLO on time per output token"})
    slo_e2e_ms: float | None = field(default=None, metadata={"help": "goodput SLO on end-to-end latency"})
    compare: list[str] | None = field(default=None, metadata={
        "help": "instead of running: read these result JSONs, print them side by side and plot them together"})
    compare_out: str = field(default="bench_compare.png", metadata={"help": "plot written by --compare"})


@dataclass(frozen=True)
class BenchConfig:
    target: TargetConfig
    workload: WorkloadConfig
    load: LoadConfig
    output: OutputConfig

    @property
    def label(self) -> str:
        return self.output.label or f"{self.target.backend}-{self.workload.workload}"


PARTS = (("target", TargetConfig), ("workload", WorkloadConfig), ("load", LoadConfig), ("output", OutputConfig))


def build_parser(prog: str = "bench_serving") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Load-test an OpenAI-compatible or /generate endpoint with a seeded workload; "
        "writes a JSON result and PNG plots, or compares earlier results (--compare).")
    for name, cls in PARTS:
        add_dataclass_args(parser, cls, group=name)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(**{name: dataclass_from_args(cls, args) for name, cls in PARTS})  # type: ignore[arg-type]
