//! SplitServe router: HTTP front door, worker registry, health, routing policies, PD pairing,
//! retries, limits and Prometheus metrics. `run` serves until SIGTERM/SIGINT.

pub mod admin;
pub mod body;
pub mod breaker;
pub mod client;
pub mod config;
pub mod discovery;
pub mod error;
pub mod health;
pub mod limits;
pub mod liveness;
pub mod metrics;
pub mod pd;
pub mod policies;
pub mod proxy;
pub mod registry;
pub mod retry;
pub mod server;
pub mod state;
pub mod text;
pub mod upstream;
pub mod worker;

pub use config::{ConfigError, PolicyKind, PrefillSpec, RouterConfig};

use state::AppState;
use std::sync::Arc;
use worker::Role;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source} (is the port in use? choose another with --port)")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

fn init_logging(level: &str) {
    let level = match level.to_ascii_lowercase().as_str() {
        "trace" => tracing::Level::TRACE,
        "debug" => tracing::Level::DEBUG,
        "warn" | "warning" => tracing::Level::WARN,
        "error" => tracing::Level::ERROR,
        _ => tracing::Level::INFO,
    };
    let _ = tracing_subscriber::fmt().with_max_level(level).with_target(false).with_ansi(false).try_init();
}

fn register_static(state: &Arc<AppState>) {
    let cfg = &state.cfg;
    let statics = cfg
        .worker_urls
        .iter()
        .map(|u| (u.as_str(), Role::Regular, None))
        .chain(cfg.prefill.iter().map(|p| (p.url.as_str(), Role::Prefill, p.bootstrap_port)))
        .chain(cfg.decode.iter().map(|u| (u.as_str(), Role::Decode, None)));
    for (url, role, port) in statics {
        match state.registry.add(url, role, port, false) {
            Ok(w) => {
                let st = state.clone();
                tokio::spawn(async move { health::probe(&st, &w).await });
            }
            Err(e) => tracing::warn!(worker = url, error = %e, "skipping worker"),
        }
    }
}

/// Runs the router until SIGTERM/SIGINT and a graceful drain.
pub fn run(cfg: RouterConfig) -> Result<(), StartError> {
    cfg.validate()?;
    init_logging(&cfg.log_level);
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if cfg.worker_threads > 0 {
        rt.worker_threads(cfg.worker_threads);
    }
    let rt = rt.enable_all().build().map_err(StartError::Runtime)?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|source| StartError::Bind { addr: addr.clone(), source })?;
        let state = AppState::new(cfg);
        register_static(&state);
        health::spawn_background(&state);
        if state.cfg.service_discovery {
            discovery::spawn(&state);
        }
        tracing::info!(addr = %addr, pd = state.cfg.pd_disaggregation, policy = %state.cfg.policy, "router listening");
        server::serve(state, listener, server::shutdown_signal()).await;
        Ok(())
    })
}
