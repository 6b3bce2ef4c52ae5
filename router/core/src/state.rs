//! Shared state of a running router.

use crate::breaker::BreakerConfig;
use crate::client::HttpClient;
use crate::config::RouterConfig;
use crate::limits::Limiter;
use crate::metrics::{Metrics, WorkerGauge};
use crate::policies::{self, Policy};
use crate::registry::Registry;
use crate::retry::Backoff;
use crate::worker::Worker;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

pub struct AppState {
    pub cfg: RouterConfig,
    pub registry: Registry,
    /// Regular mode.
    pub policy: Arc<dyn Policy>,
    pub prefill_policy: Arc<dyn Policy>,
    pub decode_policy: Arc<dyn Policy>,
    pub client: HttpClient,
    pub metrics: Metrics,
    pub limiter: Option<Limiter>,
    pub backoff: Backoff,
    pub shutting_down: AtomicBool,
}

impl AppState {
    pub fn new(cfg: RouterConfig) -> Arc<Self> {
        let breaker = BreakerConfig {
            failure_threshold: cfg.cb_failure_threshold,
            success_threshold: cfg.cb_success_threshold,
            open_for: Duration::from_secs_f64(cfg.cb_timeout_secs),
        };
        let limiter = (cfg.max_concurrent_requests > 0).then(|| {
            Limiter::new(cfg.max_concurrent_requests, cfg.queue_size, Duration::from_secs_f64(cfg.queue_timeout_secs))
        });
        Arc::new(AppState {
            registry: Registry::new(breaker),
            policy: policies::build(cfg.policy, &cfg),
            prefill_policy: policies::build(cfg.prefill_policy(), &cfg),
            decode_policy: policies::build(cfg.decode_policy(), &cfg),
            client: crate::client::build(cfg.worker_api_key.as_deref()),
            metrics: Metrics::default(),
            limiter,
            backoff: Backoff {
                initial_ms: cfg.retry_initial_backoff_ms,
                max_ms: cfg.retry_max_backoff_ms,
                multiplier: cfg.retry_backoff_multiplier,
                jitter: cfg.retry_jitter,
            },
            shutting_down: AtomicBool::new(false),
            cfg,
        })
    }

    pub fn policies(&self) -> [&Arc<dyn Policy>; 3] {
        [&self.policy, &self.prefill_policy, &self.decode_policy]
    }

    /// Forgets a worker in every policy (its tree branch, etc.).
    pub fn forget(&self, w: &Worker) {
        for p in self.policies() {
            p.on_worker_removed(&w.url);
        }
    }

    pub fn gauges(&self) -> Vec<WorkerGauge> {
        self.registry
            .all()
            .iter()
            .map(|w| WorkerGauge {
                url: w.url.clone(),
                role: w.role.as_str(),
                load: w.load(),
                reported_load: w.reported_load(),
                healthy: w.is_healthy(),
                circuit_open: w.breaker.state() == crate::breaker::BreakerState::Open,
            })
            .collect()
    }
}
