"""Prometheus metrics of a worker (names fixed by ARCHITECTURE.md, prefix ``splitserve_``). Gauges read the
engine's state when scraped; counters and histograms are fed from each step's outputs on the event loop."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from engine.engine_core import EngineCore
from engine.mem.hicache import HostTier
from engine.step_output import StepOutput

disable_created_metrics()
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                    2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    def __init__(self, core: EngineCore, role: str = "colocated", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.role = role
        r, lbl = self.registry, ["role"]
        s = core.scheduler

        def gauge(name: str, doc: str, fn: object) -> None:
            Gauge(name, doc, lbl, registry=r).labels(role).set_function(fn)  # type: ignore[arg-type]

        gauge("splitserve_num_running_reqs", "Requests admitted to the running batch", lambda: len(s.running))
        gauge("splitserve_num_queue_reqs", "Requests waiting for admission", lambda: len(s.waiting))
        gauge("splitserve_kv_pages_used", "KV pages in use (requests and prefix cache)",
              lambda: core.allocator.used)
        gauge("splitserve_kv_pages_total", "KV pages in the pool", lambda: core.allocator.capacity)
        gauge("splitserve_kv_pool_prefaulted_ratio", "Part of the KV pool faulted in ahead of use (an idle engine "
              "faults a fresh host pool in; until 1, steps may fault their new pages themselves)",
              lambda: core.pool.prefaulted_ratio)
        gauge("splitserve_radix_cache_evictable_size", "Cached tokens no request holds (evictable)",
              lambda: core.cache.evictable_size)
        gauge("splitserve_radix_cache_protected_size", "Cached tokens locked by in-flight requests",
              lambda: core.cache.protected_size)
        gauge("splitserve_prefix_cache_hit_rate", "Cached prompt tokens over prompt tokens, since start",
              lambda: self._cached / self._prompt if self._prompt else 0.0)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of finished requests", lbl,
                                     registry=r).labels(role)
        self.cached_tokens = Counter("splitserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     lbl, registry=r).labels(role)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Generated tokens", lbl,
                                         registry=r).labels(role)
        self.requests = Counter("splitserve_requests", "Finished requests by finish reason",
                                lbl + ["finish_reason"], registry=r)
        self.ttft = Histogram("splitserve_time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(role)
        self.itl = Histogram("splitserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             lbl, buckets=_LATENCY_BUCKETS, registry=r).labels(role)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds", "Arrival to last token", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(role)
        self.grammar_compile = Histogram("splitserve_grammar_compile_seconds",
                                         "Time to compile a request's grammar (cache misses)", lbl,
                                         buckets=_LATENCY_BUCKETS, registry=r).labels(role)
        self.grammar_requests = Counter("splitserve_grammar_requests", "Requests with an output constraint, by "
                                        "whether its compiled grammar came from the cache", lbl + ["cache"],
                                        registry=r)
        self.jump_forward_tokens = Counter("splitserve_grammar_jump_forward_tokens",
                                           "Output tokens a grammar forced (appended without sampling)", lbl,
                                           registry=r).labels(role)
        gauge("splitserve_grammar_cache_size", "Compiled grammars cached",
              lambda: len(core.grammars) if core.grammars is not None else 0)
        self.speculating = core.spec is not None
        self.spec_drafted = Counter("splitserve_spec_draft_tokens", "Speculative draft tokens verified", lbl,
                                    registry=r).labels(role)
        self.spec_accepted = Counter("splitserve_spec_accepted_tokens", "Speculative draft tokens accepted", lbl,
                                     registry=r).labels(role)
        self.spec_length = Histogram("splitserve_spec_accepted_length", "Draft tokens accepted per verification",
                                     lbl, buckets=tuple(range(17)), registry=r).labels(role)
        self.spec_requests = Counter("splitserve_spec_requests", "Finished requests by whether any of their drafts "
                                     "was verified (engines with speculative decoding)", lbl + ["speculation"],
                                     registry=r)
        self.step_seconds = Histogram("splitserve_engine_step_seconds", "Engine steps by what they computed: "
                                      "prefill (prompt chunks only), decode, or mixed", lbl + ["kind"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.step_tokens = Counter("splitserve_engine_step_tokens", "Token positions computed by engine steps, "
                                   "prompt (prefill) or output (decode, drafts included)", lbl + ["kind"], registry=r)
        self._steps = core.step_records
        self.hicache = core.hicache
        if self.hicache is not None:
            tier = self.hicache
            gauge("splitserve_hicache_host_pages_used", "HiCache host-tier pages holding KV",
                  lambda: tier.host.allocator.used)
            gauge("splitserve_hicache_host_pages_total", "HiCache host-tier pages",
                  lambda: tier.host.allocator.capacity)
            if tier.store is not None:
                gauge("splitserve_hicache_store_up", "1 while HiCache's shared store answers, 0 while it is "
                      "connecting or skipped after a failure", lambda: float(tier.store_state() == "up"))
            r.register(_HiCacheCounters(tier, role))
            self.hicache_load = Histogram("splitserve_hicache_load_seconds", "Time to copy one request's prefix "
                                          "from the host tier into the KV pool", lbl, buckets=_LATENCY_BUCKETS,
                                          registry=r).labels(role)
        self._drafted_rids: set[str] = set()
        self._prompt = 0
        self._cached = 0
        self._last_token: dict[str, float] = {}

    def grammar_compiled(self, seconds: float, hit: bool) -> None:
        self.grammar_requests.labels(self.role, "hit" if hit else "miss").inc()
        if not hit:
            self.grammar_compile.observe(seconds)

    def _drain_steps(self) -> None:
        steps = self._steps
        while steps:  # appended by the engine thread; deque pops are atomic
            step = steps.popleft()
            self.step_seconds.labels(self.role, step.kind).observe(step.seconds)
            self.step_tokens.labels(self.role, "prefill").inc(step.prefill_tokens)
            self.step_tokens.labels(self.role, "decode").inc(step.decode_tokens)

    def observe(self, outputs: list[StepOutput]) -> None:
        self._drain_steps()
        if self.hicache is not None:
            times = self.hicache.stats.load_seconds
            while times:  # appended by the engine thread; deque pops are atomic
                self.hicache_load.observe(times.popleft())
        for out in outputs:
            req = out.req
            if out.jumped:
                self.jump_forward_tokens.inc(out.jumped)
            if out.drafted:
                self.spec_drafted.inc(out.drafted)
                self.spec_accepted.inc(out.accepted)
                self.spec_length.observe(out.accepted)
                self._drafted_rids.add(req.rid)
            if out.new_token_ids:
                self.generation_tokens.inc(len(out.new_token_ids))
                now = req.last_token_time or 0.0
                prev = self._last_token.get(req.rid)
                if prev is None:
                    if req.first_token_time is not None:
                        self.ttft.observe(req.first_token_time - req.arrival)
                else:
                    self.itl.observe(now - prev)
                self._last_token[req.rid] = now
            if out.finished:
                self._last_token.pop(req.rid, None)
                if self.speculating:
                    on = req.rid in self._drafted_rids
                    self.spec_requests.labels(self.role, "on" if on else "off").inc()
                self._drafted_rids.discard(req.rid)
                self.requests.labels(self.role, req.finish_reason or "unknown").inc()
                if req.finish_reason != "abort" or req.output_ids:
                    self._prompt += len(req.prompt_ids)
                    self._cached += req.cached_tokens or 0
                    self.prompt_tokens.inc(len(req.prompt_ids))
                    self.cached_tokens.inc(req.cached_tokens or 0)
                if req.last_token_time is not None:
                    self.e2e.observe(req.last_token_time - req.arrival)

    def render(self) -> bytes:
        self._drain_steps()  # steps that delivered no output (a prompt's middle chunks) count too
        return generate_latest(self.registry)


class _HiCacheCounters:
    """The host tier's monotonic counters, read when scraped."""

    def __init__(self, tier: HostTier, role: str) -> None:
        self.tier, self.role = tier, role

    def collect(self) -> Iterator[Metric]:
        c = self.tier.counters()
        for name, doc in (
                ("loaded_tokens", "Prompt tokens whose KV came from the host tier (host hits)"),
                ("loaded_bytes", "Bytes copied from the host tier into the KV pool"),
                ("written_tokens", "Tokens whose KV was copied to the host tier"),
                ("written_bytes", "Bytes copied from the KV pool to the host tier"),
                ("stored_tokens", "Tokens whose KV was written to the shared store (L3)"),
                ("store_loaded_tokens", "Prompt tokens whose KV came from the shared store"),
                ("store_misses", "Store entries missing or corrupt when read (recomputed)"),
                ("store_failures", "Store operations that failed or missed their deadline (logged; requests go on)"),
                ("store_writes_dropped", "Store writes not made: the store was down or too far behind")):
            value = c[name]
            name = f"splitserve_hicache_{name}"
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
