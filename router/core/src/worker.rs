//! A worker as the router sees it: address, role, in-flight load, health, circuit breaker.

use crate::breaker::{BreakerConfig, CircuitBreaker};
use crate::liveness::Liveness;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Regular,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Regular => "regular",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "regular" => Some(Role::Regular),
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }
}

const NO_REPORT: u64 = u64::MAX;
/// Weight of a new sample in the request-duration average: 1/16.
const DURATION_SHIFT: u32 = 4;

#[derive(Debug)]
pub struct Worker {
    pub url: Arc<str>,
    /// Host part of the URL (the `bootstrap_host` sent in PD mode).
    pub host: String,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    inflight: AtomicUsize,
    reported: AtomicU64,
    healthy: AtomicBool,
    admitted: AtomicBool,
    fails: AtomicU32,
    oks: AtomicU32,
    /// Moving average of how long requests stayed in flight (ns; 0 until one finished).
    duration_ns: AtomicU64,
    pub breaker: CircuitBreaker,
    pub liveness: Liveness,
}

/// Host of an `http://host:port/...` URL, without brackets for IPv6.
pub fn url_host(url: &str) -> String {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6).to_string();
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h).to_string()
}

impl Worker {
    pub fn new(url: &str, role: Role, bootstrap_port: Option<u16>, breaker: BreakerConfig, healthy: bool) -> Arc<Self> {
        let url = url.trim_end_matches('/');
        Arc::new(Worker {
            url: Arc::from(url),
            host: url_host(url),
            role,
            bootstrap_port,
            inflight: AtomicUsize::new(0),
            reported: AtomicU64::new(NO_REPORT),
            healthy: AtomicBool::new(healthy),
            admitted: AtomicBool::new(healthy),
            fails: AtomicU32::new(0),
            oks: AtomicU32::new(0),
            duration_ns: AtomicU64::new(0),
            breaker: CircuitBreaker::new(breaker, url),
            liveness: Liveness::default(),
        })
    }

    /// Requests this router has in flight on the worker (the load cache_aware balances).
    pub fn load(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Moving average (weight 1/16 per request) of the time requests stayed in flight on this
    /// worker, from dispatch to the end of the response; None until one has finished.
    pub fn typical_duration(&self) -> Option<Duration> {
        match self.duration_ns.load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }

    pub fn record_duration(&self, d: Duration) {
        let d = (d.as_nanos() as u64).max(1);
        let _ = self.duration_ns.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            Some(if old == 0 { d } else { (old - (old >> DURATION_SHIFT) + (d >> DURATION_SHIFT)).max(1) })
        });
    }

    /// running + queued from the worker's last `/get_load` answer, if any.
    pub fn reported_load(&self) -> Option<u64> {
        match self.reported.load(Ordering::Relaxed) {
            NO_REPORT => None,
            v => Some(v),
        }
    }

    pub fn set_reported_load(&self, v: Option<u64>) {
        self.reported.store(v.unwrap_or(NO_REPORT), Ordering::Relaxed);
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Routable: healthy and the breaker lets a request through.
    pub fn is_available(&self) -> bool {
        self.is_healthy() && self.breaker.can_pass()
    }

    /// Feeds one health-check outcome; returns Some(new state) when health flips.
    pub fn health_result(&self, ok: bool, fail_threshold: u32, ok_threshold: u32) -> Option<bool> {
        if ok {
            self.fails.store(0, Ordering::Relaxed);
            let n = self.oks.fetch_add(1, Ordering::Relaxed) + 1;
            if !self.is_healthy() && n >= ok_threshold {
                self.healthy.store(true, Ordering::Relaxed);
                self.admitted.store(true, Ordering::Relaxed);
                return Some(true);
            }
        } else {
            self.oks.store(0, Ordering::Relaxed);
            let n = self.fails.fetch_add(1, Ordering::Relaxed) + 1;
            if self.is_healthy() && n >= fail_threshold {
                self.healthy.store(false, Ordering::Relaxed);
                return Some(false);
            }
        }
        None
    }

    /// Takes the worker out of rotation now (a stalled stream); a later good health check brings it back.
    pub fn mark_unhealthy(&self) -> bool {
        self.oks.store(0, Ordering::Relaxed);
        self.healthy.swap(false, Ordering::Relaxed)
    }

    /// Whether the worker has ever been healthy (a new one is admitted on its first good probe).
    pub fn admitted(&self) -> bool {
        self.admitted.load(Ordering::Relaxed)
    }
}

/// Counts a request as load on a worker from dispatch until dropped (response end, error,
/// client disconnect — whatever comes first), and feeds the worker's typical request duration.
#[derive(Debug)]
pub struct LoadGuard(Arc<Worker>, Instant);

impl LoadGuard {
    pub fn new(w: &Arc<Worker>) -> Self {
        w.inflight.fetch_add(1, Ordering::Relaxed);
        w.breaker.on_dispatch();
        LoadGuard(w.clone(), Instant::now())
    }

    pub fn worker(&self) -> &Arc<Worker> {
        &self.0
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
        self.0.record_duration(self.1.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Arc<Worker> {
        let cfg = BreakerConfig { failure_threshold: 0, success_threshold: 1, open_for: Duration::from_secs(1) };
        Worker::new("http://127.0.0.1:9", Role::Regular, None, cfg, true)
    }

    #[test]
    fn typical_duration_follows_finished_requests() {
        let w = worker();
        assert_eq!(w.typical_duration(), None);
        w.record_duration(Duration::from_millis(100));
        assert_eq!(w.typical_duration(), Some(Duration::from_millis(100)));
        for _ in 0..200 {
            w.record_duration(Duration::from_millis(10));
        }
        let d = w.typical_duration().unwrap();
        assert!(d > Duration::from_millis(9) && d < Duration::from_millis(11), "{d:?}");
    }

    #[test]
    fn host_is_taken_from_the_url() {
        assert_eq!(url_host("http://10.0.0.5:30100"), "10.0.0.5");
        assert_eq!(url_host("http://prefill-0.svc:80/x"), "prefill-0.svc");
        assert_eq!(url_host("http://[::1]:8000"), "::1");
        assert_eq!(url_host("http://localhost"), "localhost");
    }
}
