//! Whether a worker answers at all, as health probes see it.
//!
//! A probe that times out (as opposed to one answered with an error, or refused) means the process is frozen or
//! starved: the worker leaves rotation at once (health.rs), without waiting for `--health-failure-threshold`
//! probes. Once its probes have timed out without a break for `--stall-timeout-secs`, requests still waiting on it
//! for a response head (non-streamed ones wait for the whole answer) are released with `Stalled`, the same
//! deadline a stream gets for a gap between its bytes; one late probe does not fail anyone's request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Liveness {
    /// When the current run of timed-out probes began (None while probes are answered).
    silent_since: Mutex<Option<Instant>>,
    stalled: AtomicBool,
    wake: Notify,
}

impl Liveness {
    /// A probe timed out; returns whether the worker has now been silent for `stall_after`.
    pub fn timed_out(&self, now: Instant, stall_after: Duration) -> bool {
        let mut since = self.silent_since.lock().unwrap_or_else(|e| e.into_inner());
        let start = *since.get_or_insert(now);
        let stalled = now.duration_since(start) >= stall_after;
        if stalled && !self.stalled.swap(true, Ordering::Relaxed) {
            self.wake.notify_waiters();
        }
        stalled
    }

    /// A probe got an answer (good or bad): the worker is alive.
    pub fn answered(&self) {
        *self.silent_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.stalled.store(false, Ordering::Relaxed);
    }

    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    /// Resolves once the worker is stalled (at once if it already is).
    pub async fn stalled(&self) {
        loop {
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_stalled() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_late_probe_does_not_stall_a_worker_but_a_silent_run_does() {
        let l = Liveness::default();
        let t0 = Instant::now();
        let stall = Duration::from_secs(30);
        assert!(!l.timed_out(t0, stall));
        l.answered();
        assert!(!l.timed_out(t0 + Duration::from_secs(29), stall), "the run restarted after the answer");
        assert!(!l.timed_out(t0 + Duration::from_secs(40), stall));
        assert!(l.timed_out(t0 + Duration::from_secs(59), stall));
        assert!(l.is_stalled());
        l.answered();
        assert!(!l.is_stalled());
    }

    #[tokio::test]
    async fn waiters_are_released_when_the_worker_stalls() {
        let l = std::sync::Arc::new(Liveness::default());
        let waiter = tokio::spawn({
            let l = l.clone();
            async move { l.stalled().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        let t0 = Instant::now();
        l.timed_out(t0, Duration::from_secs(1));
        l.timed_out(t0 + Duration::from_secs(2), Duration::from_secs(1));
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("released").unwrap();
        tokio::time::timeout(Duration::from_secs(1), l.stalled()).await.expect("at once when already stalled");
    }
}
