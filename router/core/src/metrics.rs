//! Router metrics in the Prometheus text format, prefix `splitserve_router_`.
//!
//! | name | type | labels |
//! | --- | --- | --- |
//! | `splitserve_router_requests_total` | counter | `route`, `worker`, `status` |
//! | `splitserve_router_retries_total` | counter | `route` |
//! | `splitserve_router_rejected_total` | counter | `reason` (`auth`, `payload`, `queue_full`, `queue_timeout`, `timeout`, `no_worker`) |
//! | `splitserve_router_pd_prefill_failures_total` | counter | |
//! | `splitserve_router_queued_requests` | gauge | (waiting for a concurrency slot) |
//! | `splitserve_router_worker_load` | gauge | `worker`, `role` (requests in flight from this router) |
//! | `splitserve_router_worker_reported_load` | gauge | `worker`, `role` (running + queued from `/get_load`) |
//! | `splitserve_router_worker_healthy` | gauge | `worker`, `role` |
//! | `splitserve_router_worker_circuit_open` | gauge | `worker`, `role` |
//! | `splitserve_router_prefix_match_ratio` | histogram | (cache_aware: matched share of the chosen worker) |
//! | `splitserve_router_routing_decision_seconds` | histogram | |
//! | `splitserve_router_request_duration_seconds` | histogram | `route` (until the response head) |

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const RATIO_BUCKETS: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0];
const DECISION_BUCKETS: &[f64] = &[1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2];
const DURATION_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0];

pub const ROUTES: [&str; 6] = ["/generate", "/v1/completions", "/v1/chat/completions", "other", "/health_generate", "/flush_cache"];

pub struct Histogram {
    buckets: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(buckets: &'static [f64]) -> Self {
        Histogram {
            buckets,
            counts: buckets.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.buckets.iter().position(|&b| v <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_nanos.fetch_add((v * 1e9) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cum = 0;
        for (b, c) in self.buckets.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {count}");
    }
}

/// What the registry reports per worker at scrape time.
pub struct WorkerGauge {
    pub url: Arc<str>,
    pub role: &'static str,
    pub load: usize,
    pub reported_load: Option<u64>,
    pub healthy: bool,
    pub circuit_open: bool,
}

pub struct Metrics {
    requests: Mutex<HashMap<(&'static str, Arc<str>, u16), u64>>,
    retries: Mutex<HashMap<&'static str, u64>>,
    rejected: Mutex<HashMap<&'static str, u64>>,
    pd_prefill_failures: AtomicU64,
    pub match_ratio: Histogram,
    pub decision: Histogram,
    durations: Vec<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            retries: Mutex::default(),
            rejected: Mutex::default(),
            pd_prefill_failures: AtomicU64::new(0),
            match_ratio: Histogram::new(RATIO_BUCKETS),
            decision: Histogram::new(DECISION_BUCKETS),
            durations: ROUTES.iter().map(|_| Histogram::new(DURATION_BUCKETS)).collect(),
        }
    }
}

fn bump<K: std::hash::Hash + Eq>(m: &Mutex<HashMap<K, u64>>, k: K) {
    *m.lock().unwrap_or_else(|e| e.into_inner()).entry(k).or_insert(0) += 1;
}

/// Escapes a label value for the text format.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

pub fn route_label(path: &str) -> &'static str {
    ROUTES.iter().find(|r| **r == path).copied().unwrap_or("other")
}

impl Metrics {
    pub fn request(&self, route: &'static str, worker: &Arc<str>, status: u16) {
        bump(&self.requests, (route, worker.clone(), status));
    }
    pub fn retry(&self, route: &'static str) {
        bump(&self.retries, route);
    }
    pub fn rejected(&self, reason: &'static str) {
        bump(&self.rejected, reason);
    }
    pub fn prefill_failure(&self) {
        self.pd_prefill_failures.fetch_add(1, Ordering::Relaxed);
    }
    pub fn duration(&self, route: &'static str, secs: f64) {
        let i = ROUTES.iter().position(|r| *r == route).unwrap_or(3);
        self.durations[i].observe(secs);
    }

    pub fn render(&self, workers: &[WorkerGauge], queued: usize) -> String {
        let mut o = String::with_capacity(4096);
        let p = "splitserve_router_";
        let _ = writeln!(o, "# HELP {p}requests_total Requests answered, by route, worker and status.\n# TYPE {p}requests_total counter");
        for ((route, worker, status), n) in self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(o, "{p}requests_total{{route=\"{route}\",worker=\"{}\",status=\"{status}\"}} {n}", esc(worker));
        }
        let _ = writeln!(o, "# HELP {p}retries_total Attempts repeated on another worker or pair.\n# TYPE {p}retries_total counter");
        for (route, n) in self.retries.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(o, "{p}retries_total{{route=\"{route}\"}} {n}");
        }
        let _ = writeln!(o, "# HELP {p}rejected_total Requests the router refused itself, by reason.\n# TYPE {p}rejected_total counter");
        for (reason, n) in self.rejected.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(o, "{p}rejected_total{{reason=\"{reason}\"}} {n}");
        }
        let _ = writeln!(o, "# HELP {p}pd_prefill_failures_total PD requests failed by their prefill worker.\n# TYPE {p}pd_prefill_failures_total counter");
        let _ = writeln!(o, "{p}pd_prefill_failures_total {}", self.pd_prefill_failures.load(Ordering::Relaxed));
        let _ = writeln!(o, "# HELP {p}queued_requests Requests waiting for a concurrency slot.\n# TYPE {p}queued_requests gauge\n{p}queued_requests {queued}");
        for (name, help) in [
            ("worker_load", "Requests in flight from this router to the worker."),
            ("worker_reported_load", "running + queued as reported by the worker's /get_load."),
            ("worker_healthy", "1 if the worker passes health checks."),
            ("worker_circuit_open", "1 if the worker's circuit breaker is open."),
        ] {
            let _ = writeln!(o, "# HELP {p}{name} {help}\n# TYPE {p}{name} gauge");
            for w in workers {
                let v = match name {
                    "worker_load" => w.load as f64,
                    "worker_reported_load" => match w.reported_load {
                        Some(v) => v as f64,
                        None => continue,
                    },
                    "worker_healthy" => w.healthy as u8 as f64,
                    _ => w.circuit_open as u8 as f64,
                };
                let _ = writeln!(o, "{p}{name}{{worker=\"{}\",role=\"{}\"}} {v}", esc(&w.url), w.role);
            }
        }
        let _ = writeln!(o, "# HELP {p}prefix_match_ratio Matched share of the request text at the worker cache_aware chose.\n# TYPE {p}prefix_match_ratio histogram");
        self.match_ratio.render(&mut o, &format!("{p}prefix_match_ratio"), "");
        let _ = writeln!(o, "# HELP {p}routing_decision_seconds Time the policy took to choose.\n# TYPE {p}routing_decision_seconds histogram");
        self.decision.render(&mut o, &format!("{p}routing_decision_seconds"), "");
        let _ = writeln!(o, "# HELP {p}request_duration_seconds Time until the response head was sent.\n# TYPE {p}request_duration_seconds histogram");
        for (route, h) in ROUTES.iter().zip(&self.durations) {
            h.render(&mut o, &format!("{p}request_duration_seconds"), &format!("route=\"{route}\""));
        }
        o
    }
}
