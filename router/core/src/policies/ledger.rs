//! cache_aware's balance ledger: each worker's recent share of the requests the policy routed
//! (a count that decays by a factor (1 - 1/HORIZON) per decision), the decision at which each
//! worker last shed a prefix, and the copies of prefixes that shedding started on another
//! worker and that are still being computed there ("warming").
//!
//! A warming copy is not in the prefix tree yet: until the request that carries it has had
//! time to finish (the target worker's typical request duration), more requests for the prefix
//! would find no cached pages there either, so they keep going to the workers that hold it.

use crate::worker::Worker;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Decisions over which a routed request's weight in the shares decays by a factor e.
pub const HORIZON: f64 = 1024.0;
/// Decisions a worker waits after shedding a prefix before it may shed another.
pub const COOLDOWN: u64 = 64;

#[derive(Debug, Default)]
struct Entry {
    share: f64,
    last_shed: Option<u64>,
}

/// A prefix copy that shedding started on `worker`; it joins the tree at `ready`.
#[derive(Debug)]
pub struct Warming {
    pub worker: Arc<str>,
    pub text: Vec<u8>,
    pub ready: Instant,
}

/// Per worker, as seen at the start of one decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Standing {
    /// The worker's recent share of routed requests over the mean share (1.0 = its fair part).
    pub share_ratio: f64,
    /// It shed a prefix less than COOLDOWN decisions ago.
    pub cooling: bool,
}

#[derive(Debug, Default)]
pub struct Ledger {
    decisions: u64,
    workers: HashMap<Arc<str>, Entry>,
    warming: Vec<Warming>,
}

impl Ledger {
    /// The standing of each of `workers` (routable now).
    pub fn standings(&self, workers: &[Arc<Worker>]) -> Vec<Standing> {
        let shares: Vec<f64> = workers.iter().map(|w| self.workers.get(&w.url).map_or(0.0, |e| e.share)).collect();
        let mean = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
        workers
            .iter()
            .zip(&shares)
            .map(|(w, &s)| Standing {
                share_ratio: if mean > 0.0 { s / mean } else { 1.0 },
                cooling: self
                    .workers
                    .get(&w.url)
                    .and_then(|e| e.last_shed)
                    .is_some_and(|d| self.decisions - d < COOLDOWN),
            })
            .collect()
    }

    /// Counts one request routed to `chosen`; every share decays one step.
    pub fn record(&mut self, workers: &[Arc<Worker>], chosen: &Arc<str>) {
        let keep = 1.0 - 1.0 / HORIZON;
        for w in workers {
            if !self.workers.contains_key(&w.url) {
                self.workers.insert(w.url.clone(), Entry::default());
            }
        }
        for (url, e) in self.workers.iter_mut() {
            e.share = e.share * keep + if url == chosen { 1.0 } else { 0.0 };
        }
        self.decisions += 1;
    }

    /// `worker` shed a prefix at this decision.
    pub fn shed(&mut self, worker: &Arc<str>) {
        let d = self.decisions;
        self.workers.entry(worker.clone()).or_default().last_shed = Some(d);
    }

    pub fn warm(&mut self, w: Warming) {
        self.warming.push(w);
    }

    /// The warming copies whose time has come (they go into the tree now).
    pub fn take_ready(&mut self, now: Instant) -> Vec<Warming> {
        if self.warming.is_empty() {
            return Vec::new();
        }
        let (ready, rest): (Vec<Warming>, Vec<Warming>) = self.warming.drain(..).partition(|w| w.ready <= now);
        self.warming = rest;
        ready
    }

    /// Forgets everything (the workers' caches were flushed).
    pub fn clear(&mut self) {
        *self = Ledger::default();
    }

    pub fn forget(&mut self, url: &str) {
        self.workers.remove(url);
        self.warming.retain(|w| &*w.worker != url);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_util::workers;
    use std::time::Duration;

    #[test]
    fn shares_follow_where_requests_went() {
        let (ws, _g) = workers(&[0, 0]);
        let mut l = Ledger::default();
        for i in 0..300 {
            l.record(&ws, &ws[if i % 3 == 0 { 1 } else { 0 }].url);
        }
        let s = l.standings(&ws);
        assert!((s[0].share_ratio - 4.0 / 3.0).abs() < 0.02, "{s:?}");
        assert!((s[1].share_ratio - 2.0 / 3.0).abs() < 0.02, "{s:?}");
    }

    #[test]
    fn a_worker_that_shed_cools_down_for_a_number_of_decisions() {
        let (ws, _g) = workers(&[0, 0]);
        let mut l = Ledger::default();
        l.shed(&ws[0].url);
        for _ in 0..COOLDOWN - 1 {
            l.record(&ws, &ws[1].url);
            assert!(l.standings(&ws)[0].cooling);
        }
        l.record(&ws, &ws[1].url);
        assert!(!l.standings(&ws)[0].cooling);
        assert!(!l.standings(&ws)[1].cooling);
    }

    #[test]
    fn warming_copies_are_released_when_ready() {
        let (ws, _g) = workers(&[0]);
        let mut l = Ledger::default();
        let t = Instant::now();
        l.warm(Warming { worker: ws[0].url.clone(), text: b"abc".to_vec(), ready: t + Duration::from_millis(10) });
        assert!(l.take_ready(t).is_empty());
        let r = l.take_ready(t + Duration::from_millis(10));
        assert_eq!(r.len(), 1);
        assert!(l.take_ready(t + Duration::from_secs(1)).is_empty());
    }
}
