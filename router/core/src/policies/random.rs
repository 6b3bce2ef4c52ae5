//! random — cost(w) = U(0,1) drawn per request: a uniformly random worker.

use super::{Choice, Policy, RouteRequest};
use crate::worker::Worker;
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&self, workers: &[Arc<Worker>], _req: &RouteRequest<'_>) -> Option<Choice> {
        if workers.is_empty() {
            return None;
        }
        Some(Choice { index: fastrand::usize(..workers.len()), match_ratio: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_util::workers;

    #[test]
    fn reaches_every_worker_and_stays_in_range() {
        let (ws, _g) = workers(&[0, 0, 0, 0]);
        let mut seen = [0usize; 4];
        for _ in 0..4000 {
            seen[RandomPolicy.select(&ws, &RouteRequest::default()).unwrap().index] += 1;
        }
        assert!(seen.iter().all(|&n| (700..1300).contains(&n)), "{seen:?}");
    }
}
