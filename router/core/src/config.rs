//! The router's configuration. Every default is declared here, once: the Python front
//! (`router/config.py`) reads them through the bindings (`defaults_json`), and a test checks
//! that both sides agree field by field.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// hyper's read buffer for a request head. Heads over `--max-header-size` but within this buffer are answered
/// with the usual JSON error (431, `header_too_large`); past it, hyper itself closes with a bare 431.
pub const HEAD_BUFFER: usize = 2 << 20;

/// Routing policies; the names are the CLI values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    CacheAware,
    RoundRobin,
    Random,
    PowerOfTwo,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] =
        [PolicyKind::CacheAware, PolicyKind::RoundRobin, PolicyKind::Random, PolicyKind::PowerOfTwo];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::PowerOfTwo => "power_of_two",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| ConfigError::Invalid(format!("unknown policy {s:?}; use one of cache_aware, round_robin, random, power_of_two")))
    }
}

/// A prefill worker: its URL and the bootstrap (handshake) port given after it on the CLI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillSpec {
    pub url: String,
    pub bootstrap_port: Option<u16>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid router configuration: {0}")]
    Invalid(String),
    #[error("router configuration is not valid JSON for RouterConfig: {0}")]
    Json(#[from] serde_json::Error),
}

/// All settings. Field names are the CLI flags with `-` written as `_`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    pub host: String,
    pub port: u16,
    pub worker_urls: Vec<String>,
    pub pd_disaggregation: bool,
    pub prefill: Vec<PrefillSpec>,
    pub decode: Vec<String>,
    pub policy: PolicyKind,
    pub prefill_policy: Option<PolicyKind>,
    pub decode_policy: Option<PolicyKind>,
    pub cache_threshold: f64,
    pub balance_abs_threshold: usize,
    pub balance_rel_threshold: f64,
    pub eviction_interval_secs: f64,
    pub max_tree_size: usize,
    pub load_poll_interval_secs: f64,
    pub max_payload_size: usize,
    pub max_header_size: usize,
    pub request_timeout_secs: f64,
    pub stall_timeout_secs: f64,
    pub max_concurrent_requests: usize,
    pub queue_size: usize,
    pub queue_timeout_secs: f64,
    pub max_retries: u32,
    pub retry_initial_backoff_ms: u64,
    pub retry_max_backoff_ms: u64,
    pub retry_backoff_multiplier: f64,
    pub retry_jitter: f64,
    pub health_check_interval_secs: f64,
    pub health_check_timeout_secs: f64,
    pub health_failure_threshold: u32,
    pub health_success_threshold: u32,
    pub health_check_endpoint: String,
    pub cb_failure_threshold: u32,
    pub cb_success_threshold: u32,
    pub cb_timeout_secs: f64,
    pub api_key: Option<String>,
    pub worker_api_key: Option<String>,
    pub shutdown_grace_period_secs: f64,
    pub log_level: String,
    pub worker_threads: usize,
    pub service_discovery: bool,
    pub selector: Vec<String>,
    pub prefill_selector: Vec<String>,
    pub decode_selector: Vec<String>,
    pub service_discovery_namespace: String,
    pub service_discovery_port: u16,
    pub bootstrap_port_annotation: String,
    pub k8s_api_url: Option<String>,
    pub discovery_relist_interval_secs: f64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            worker_urls: Vec::new(),
            pd_disaggregation: false,
            prefill: Vec::new(),
            decode: Vec::new(),
            policy: PolicyKind::CacheAware,
            prefill_policy: None,
            decode_policy: None,
            cache_threshold: 0.5,
            balance_abs_threshold: 3,
            balance_rel_threshold: 1.1,
            eviction_interval_secs: 60.0,
            max_tree_size: 1 << 24,
            load_poll_interval_secs: 0.5,
            max_payload_size: 64 << 20, // the workers' default too (engine ServerConfig; a test checks)
            max_header_size: 64 << 10,  // likewise
            request_timeout_secs: 1800.0,
            stall_timeout_secs: 30.0,
            max_concurrent_requests: 1024,
            queue_size: 256,
            queue_timeout_secs: 60.0,
            max_retries: 3,
            retry_initial_backoff_ms: 20,
            retry_max_backoff_ms: 1000,
            retry_backoff_multiplier: 2.0,
            retry_jitter: 0.2,
            health_check_interval_secs: 5.0,
            health_check_timeout_secs: 3.0,
            health_failure_threshold: 3,
            health_success_threshold: 2,
            health_check_endpoint: "/health".into(),
            cb_failure_threshold: 5,
            cb_success_threshold: 2,
            cb_timeout_secs: 10.0,
            api_key: None,
            worker_api_key: None,
            shutdown_grace_period_secs: 30.0,
            log_level: "info".into(),
            worker_threads: 0,
            service_discovery: false,
            selector: Vec::new(),
            prefill_selector: Vec::new(),
            decode_selector: Vec::new(),
            service_discovery_namespace: "default".into(),
            service_discovery_port: 8000,
            bootstrap_port_annotation: "splitserve.io/bootstrap-port".into(),
            k8s_api_url: None,
            discovery_relist_interval_secs: 30.0,
        }
    }
}

fn check_url(url: &str) -> Result<(), ConfigError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        ConfigError::Invalid(format!("worker URL {url:?} must start with http:// (e.g. http://127.0.0.1:30000)"))
    })?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(ConfigError::Invalid(format!("worker URL {url:?} has no host")));
    }
    Ok(())
}

fn positive(name: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::Invalid(format!("{name} must be a positive number of seconds, got {v}")))
    }
}

impl RouterConfig {
    pub fn from_json(s: &str) -> Result<Self, ConfigError> {
        let cfg: RouterConfig = serde_json::from_str(s)?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn prefill_policy(&self) -> PolicyKind {
        self.prefill_policy.unwrap_or(self.policy)
    }

    pub fn decode_policy(&self) -> PolicyKind {
        self.decode_policy.unwrap_or(self.policy)
    }

    /// Checks everything that can be checked before starting; messages name the flag to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.pd_disaggregation {
            if !self.worker_urls.is_empty() {
                return bad("--worker-urls is for regular mode; in PD mode use --prefill and --decode".into());
            }
            if !self.service_discovery && (self.prefill.is_empty() || self.decode.is_empty()) {
                return bad("--pd-disaggregation needs at least one --prefill URL and one --decode URL (or --service-discovery)".into());
            }
        } else if !self.prefill.is_empty() || !self.decode.is_empty() {
            return bad("--prefill/--decode need --pd-disaggregation".into());
        }
        for u in self.worker_urls.iter().chain(&self.decode).chain(self.prefill.iter().map(|p| &p.url)) {
            check_url(u)?;
        }
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return bad(format!("--cache-threshold must be within [0, 1], got {}", self.cache_threshold));
        }
        if !(self.balance_rel_threshold >= 1.0) {
            return bad(format!("--balance-rel-threshold must be >= 1.0, got {}", self.balance_rel_threshold));
        }
        if !(0.0..=1.0).contains(&self.retry_jitter) {
            return bad(format!("--retry-jitter must be within [0, 1], got {}", self.retry_jitter));
        }
        if !(self.retry_backoff_multiplier >= 1.0) {
            return bad("--retry-backoff-multiplier must be >= 1.0".into());
        }
        for (n, v) in [
            ("--eviction-interval-secs", self.eviction_interval_secs),
            ("--load-poll-interval-secs", self.load_poll_interval_secs),
            ("--request-timeout-secs", self.request_timeout_secs),
            ("--stall-timeout-secs", self.stall_timeout_secs),
            ("--queue-timeout-secs", self.queue_timeout_secs),
            ("--health-check-interval-secs", self.health_check_interval_secs),
            ("--health-check-timeout-secs", self.health_check_timeout_secs),
            ("--cb-timeout-secs", self.cb_timeout_secs),
            ("--shutdown-grace-period-secs", self.shutdown_grace_period_secs),
            ("--discovery-relist-interval-secs", self.discovery_relist_interval_secs),
        ] {
            positive(n, v)?;
        }
        if self.health_failure_threshold == 0 || self.health_success_threshold == 0 {
            return bad("--health-failure-threshold and --health-success-threshold must be >= 1".into());
        }
        if !self.health_check_endpoint.starts_with('/') {
            return bad("--health-check-endpoint must start with /".into());
        }
        if self.max_payload_size == 0 {
            return bad("--max-payload-size must be > 0".into());
        }
        if self.max_header_size < 1024 || self.max_header_size > HEAD_BUFFER / 2 {
            return bad(format!("--max-header-size must be between 1024 and {} bytes", HEAD_BUFFER / 2));
        }
        if matches!(&self.api_key, Some(k) if k.is_empty()) {
            return bad("--api-key must not be empty".into());
        }
        if matches!(&self.worker_api_key, Some(k) if k.is_empty() || http::HeaderValue::from_str(k).is_err()) {
            return bad("--worker-api-key must be non-empty printable ASCII".into());
        }
        if self.service_discovery {
            if let Some(u) = &self.k8s_api_url {
                if !u.starts_with("http://") {
                    return bad(format!("--k8s-api-url {u:?}: only plain http is supported; run `kubectl proxy` as a sidecar and use http://127.0.0.1:8001"));
                }
            }
            let sel = |v: &Vec<String>| v.iter().all(|s| s.split_once('=').is_some_and(|(k, _)| !k.is_empty()));
            if !sel(&self.selector) || !sel(&self.prefill_selector) || !sel(&self.decode_selector) {
                return bad("selectors must be key=value".into());
            }
            if self.pd_disaggregation && (self.prefill_selector.is_empty() || self.decode_selector.is_empty()) {
                return bad("PD service discovery needs --prefill-selector and --decode-selector".into());
            }
            if !self.pd_disaggregation && self.selector.is_empty() {
                return bad("service discovery needs --selector key=value".into());
            }
        } else if self.worker_urls.is_empty() && !self.pd_disaggregation {
            // Allowed: workers can be added later through POST /workers.
        }
        Ok(())
    }
}
