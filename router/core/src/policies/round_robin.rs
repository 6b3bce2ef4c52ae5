//! round_robin — cost(w_i) = (i - counter) mod n: the next worker in turn, ignoring load and cache.

use super::{Choice, Policy, RouteRequest};
use crate::worker::Worker;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, workers: &[Arc<Worker>], _req: &RouteRequest<'_>) -> Option<Choice> {
        if workers.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % workers.len();
        Some(Choice { index: i, match_ratio: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_util::workers;

    #[test]
    fn cycles_through_every_worker_regardless_of_load() {
        let (ws, _g) = workers(&[5, 0, 9]);
        let p = RoundRobin::default();
        let picks: Vec<usize> = (0..6).map(|_| p.select(&ws, &RouteRequest::default()).unwrap().index).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert!(p.select(&[], &RouteRequest::default()).is_none());
    }
}
