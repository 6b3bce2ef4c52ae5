//! Routing policies behind one trait. Each policy lives in its own file with its cost formula
//! at the top. A policy sees only the workers that are routable right now (healthy, breaker
//! closed or half-open with a free trial slot, not draining) and returns the index it chose.

mod cache_aware;
mod ledger;
mod power_of_two;
mod random;
mod round_robin;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use power_of_two::PowerOfTwo;
pub use random::RandomPolicy;
pub use round_robin::RoundRobin;

use crate::config::{PolicyKind, RouterConfig};
use crate::worker::Worker;
use std::sync::Arc;

/// What a policy may look at about a request.
#[derive(Debug, Default, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The request's routing text (prompt or rendered messages), when the policy asked for it.
    pub text: Option<&'a [u8]>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub index: usize,
    /// cache_aware only: matched share of the request text at the chosen worker.
    pub match_ratio: Option<f64>,
}

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether `select` wants the request text (the router then extracts it from the body).
    fn needs_text(&self) -> bool {
        false
    }
    /// Picks one of `workers` (all routable); None only when `workers` is empty.
    fn select(&self, workers: &[Arc<Worker>], req: &RouteRequest<'_>) -> Option<Choice>;
    fn on_worker_removed(&self, _url: &str) {}
    /// Workers' caches were flushed: forget what the policy assumed about them.
    fn reset(&self) {}
    /// Periodic housekeeping (cache_aware: LRU eviction of its tree).
    fn maintenance(&self) {}
}

pub fn build(kind: PolicyKind, cfg: &RouterConfig) -> Arc<dyn Policy> {
    match kind {
        PolicyKind::CacheAware => Arc::new(CacheAware::new(CacheAwareConfig::from(cfg))),
        PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyKind::Random => Arc::new(RandomPolicy),
        PolicyKind::PowerOfTwo => Arc::new(PowerOfTwo),
    }
}

/// Index of the smallest key, scanning from a rotating start so that ties spread out.
pub(crate) fn argmin_rotating<K: PartialOrd>(n: usize, start: usize, key: impl Fn(usize) -> K) -> Option<usize> {
    let mut best: Option<(usize, K)> = None;
    for k in 0..n {
        let i = (start + k) % n;
        let v = key(i);
        if best.as_ref().is_none_or(|(_, b)| v < *b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
pub(crate) mod test_util {
    use crate::breaker::BreakerConfig;
    use crate::worker::{LoadGuard, Role, Worker};
    use std::sync::Arc;
    use std::time::Duration;

    /// Workers with the given in-flight loads (the guards keep the load up while alive).
    pub fn workers(loads: &[usize]) -> (Vec<Arc<Worker>>, Vec<LoadGuard>) {
        let cfg = BreakerConfig { failure_threshold: 0, success_threshold: 1, open_for: Duration::from_secs(1) };
        let ws: Vec<_> = (0..loads.len())
            .map(|i| Worker::new(&format!("http://127.0.0.1:{}", 9000 + i), Role::Regular, None, cfg, true))
            .collect();
        let guards = ws.iter().zip(loads).flat_map(|(w, &n)| (0..n).map(move |_| LoadGuard::new(w))).collect();
        (ws, guards)
    }
}
