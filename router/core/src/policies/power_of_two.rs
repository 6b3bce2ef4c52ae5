//! power_of_two — sample two distinct workers a, b at random; choose the one with the lower
//! cost(w) = max(reported_w, inflight_w), where reported_w = running + queued from the worker's
//! `GET /get_load` (polled every --load-poll-interval-secs) and inflight_w = requests this
//! router has dispatched to w and not yet seen finish (fresh between polls; covers workers
//! that have not answered a poll yet). Ties go to the first sample.

use super::{Choice, Policy, RouteRequest};
use crate::worker::Worker;
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct PowerOfTwo;

pub fn cost(w: &Worker) -> u64 {
    w.reported_load().unwrap_or(0).max(w.load() as u64)
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, workers: &[Arc<Worker>], _req: &RouteRequest<'_>) -> Option<Choice> {
        let n = workers.len();
        match n {
            0 => None,
            1 => Some(Choice { index: 0, match_ratio: None }),
            _ => {
                let a = fastrand::usize(..n);
                let b = (a + 1 + fastrand::usize(..n - 1)) % n;
                let index = if cost(&workers[b]) < cost(&workers[a]) { b } else { a };
                Some(Choice { index, match_ratio: None })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_util::workers;

    #[test]
    fn never_picks_the_more_loaded_of_two() {
        let (ws, _g) = workers(&[0, 0]);
        ws[0].set_reported_load(Some(10));
        ws[1].set_reported_load(Some(3));
        for _ in 0..200 {
            assert_eq!(PowerOfTwo.select(&ws, &RouteRequest::default()).unwrap().index, 1);
        }
    }

    #[test]
    fn router_inflight_counts_when_it_exceeds_the_report() {
        let (ws, _g) = workers(&[7, 0]);
        ws[0].set_reported_load(Some(1));
        ws[1].set_reported_load(Some(2));
        for _ in 0..200 {
            assert_eq!(PowerOfTwo.select(&ws, &RouteRequest::default()).unwrap().index, 1);
        }
    }

    #[test]
    fn the_most_loaded_of_many_is_never_chosen() {
        let (ws, _g) = workers(&[0, 0, 0, 0]);
        for (i, w) in ws.iter().enumerate() {
            w.set_reported_load(Some(if i == 2 { 50 } else { i as u64 }));
        }
        for _ in 0..500 {
            assert_ne!(PowerOfTwo.select(&ws, &RouteRequest::default()).unwrap().index, 2);
        }
    }
}
