//! Per-worker circuit breaker: Closed → (N consecutive failures) → Open for a cool-down →
//! HalfOpen, which lets one trial request through at a time → Closed after M successes, or back
//! to Open on a failure. A threshold of 0 disables the breaker.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    pub failure_threshold: u32,
    pub success_threshold: u32,
    pub open_for: Duration,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    failures: u32,
    successes: u32,
    opened_at: Instant,
    /// When the half-open trial was sent. A trial that never reports back (its attempt was dropped: the other
    /// leg of a PD pair failed first, the client left) expires after `open_for`, so it cannot keep the worker
    /// out of rotation for good.
    trial_since: Option<Instant>,
}

#[derive(Debug)]
pub struct CircuitBreaker {
    cfg: BreakerConfig,
    worker: String, // for the log lines when it opens and closes
    inner: Mutex<Inner>,
}

impl CircuitBreaker {
    pub fn new(cfg: BreakerConfig, worker: &str) -> Self {
        CircuitBreaker {
            cfg,
            worker: worker.to_string(),
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                failures: 0,
                successes: 0,
                opened_at: Instant::now(),
                trial_since: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn state(&self) -> BreakerState {
        self.lock().state
    }

    /// Whether a request could be sent now (does not reserve the half-open trial).
    pub fn can_pass(&self) -> bool {
        if self.cfg.failure_threshold == 0 {
            return true;
        }
        let g = self.lock();
        match g.state {
            BreakerState::Closed => true,
            BreakerState::Open => g.opened_at.elapsed() >= self.cfg.open_for,
            BreakerState::HalfOpen => g.trial_since.is_none_or(|t| t.elapsed() >= self.cfg.open_for),
        }
    }

    /// Called when a request is actually sent to the worker.
    pub fn on_dispatch(&self) {
        if self.cfg.failure_threshold == 0 {
            return;
        }
        let mut g = self.lock();
        if g.state == BreakerState::Open && g.opened_at.elapsed() >= self.cfg.open_for {
            g.state = BreakerState::HalfOpen;
            g.successes = 0;
        }
        if g.state == BreakerState::HalfOpen {
            g.trial_since = Some(Instant::now());
        }
    }

    pub fn record(&self, success: bool) {
        if self.cfg.failure_threshold == 0 {
            return;
        }
        let mut g = self.lock();
        g.trial_since = None;
        if success {
            g.failures = 0;
            if g.state == BreakerState::HalfOpen {
                g.successes += 1;
                if g.successes >= self.cfg.success_threshold.max(1) {
                    g.state = BreakerState::Closed;
                    tracing::info!(worker = %self.worker, "circuit breaker closed: the worker gets requests again");
                }
            }
        } else {
            g.successes = 0;
            g.failures += 1;
            if g.state == BreakerState::HalfOpen || g.failures >= self.cfg.failure_threshold {
                if g.state != BreakerState::Open {
                    tracing::warn!(worker = %self.worker, failures = g.failures, open_for_s = self.cfg.open_for.as_secs_f64(),
                                   "circuit breaker opened: the worker gets no new requests for a while");
                }
                g.state = BreakerState::Open;
                g.opened_at = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cb(ms: u64) -> CircuitBreaker {
        CircuitBreaker::new(BreakerConfig { failure_threshold: 2, success_threshold: 2, open_for: Duration::from_millis(ms) }, "w")
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = cb(10_000);
        b.record(false);
        b.record(true);
        b.record(false);
        assert_eq!(b.state(), BreakerState::Closed);
        b.record(false);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.can_pass());
    }

    /// A breaker opened by two failures whose 30 ms cool-down is over.
    fn cooled_down() -> CircuitBreaker {
        let b = cb(30);
        b.record(false);
        b.record(false);
        std::thread::sleep(Duration::from_millis(40));
        b
    }

    #[test]
    fn half_open_admits_one_trial_and_closes_after_successes() {
        let b = cooled_down();
        assert!(b.can_pass(), "the cool-down is over");
        b.on_dispatch();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(!b.can_pass(), "only one trial at a time");
        b.record(true);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        b.on_dispatch();
        b.record(true);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_trial_that_never_reports_back_does_not_shut_the_worker_out() {
        let b = cooled_down();
        b.on_dispatch(); // the trial's attempt is then dropped without a record()
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(!b.can_pass(), "the trial is still in flight");
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.can_pass(), "a lost trial expires, and another one may go");
        b.on_dispatch();
        b.record(true);
        b.on_dispatch();
        b.record(true);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn half_open_failure_reopens() {
        let b = cb(0);
        b.record(false);
        b.record(false);
        b.on_dispatch();
        b.record(false);
        assert_eq!(b.state(), BreakerState::Open);
    }
}
