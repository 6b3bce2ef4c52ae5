//! Background tasks: health checks with failure/success thresholds, the `/get_load` poller
//! (power_of_two), and periodic maintenance (cache_aware tree eviction, expired idle connections).

use crate::client::{get_ok, ProbeError};
use crate::config::PolicyKind;
use crate::state::AppState;
use crate::worker::Worker;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One probe of `w`, applied with the configured thresholds. A worker that has never been
/// healthy is admitted on its first good probe; one whose probe times out leaves rotation at once
/// (crate::liveness).
pub async fn probe(state: &AppState, w: &Arc<Worker>) -> bool {
    let url = format!("{}{}", w.url, state.cfg.health_check_endpoint);
    let res = get_ok(&state.client, &url, Duration::from_secs_f64(state.cfg.health_check_timeout_secs)).await;
    let ok = res.is_ok();
    if let Err(ProbeError::Timeout(_)) = &res {
        let stall = Duration::from_secs_f64(state.cfg.stall_timeout_secs);
        if w.liveness.timed_out(Instant::now(), stall) {
            tracing::warn!(worker = %w.url, "health probes have timed out for --stall-timeout-secs; failing the requests waiting on it");
        }
        if w.mark_unhealthy() {
            tracing::warn!(worker = %w.url, "health probe timed out; worker out of rotation at once");
        }
    } else {
        w.liveness.answered();
    }
    let ok_threshold = if w.admitted() { state.cfg.health_success_threshold } else { 1 };
    match w.health_result(ok, state.cfg.health_failure_threshold, ok_threshold) {
        Some(true) => tracing::info!(worker = %w.url, "worker healthy"),
        Some(false) => tracing::warn!(worker = %w.url, error = %res.err().map(|e| e.to_string()).unwrap_or_default(), "worker unhealthy; no new requests go there"),
        None => {}
    }
    ok
}

/// Every `period`, runs `each` on all registered workers concurrently and waits for all.
async fn every_worker<F, Fut>(state: Arc<AppState>, period: Duration, each: F)
where
    F: Fn(Arc<AppState>, Arc<Worker>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut set = tokio::task::JoinSet::new();
        for w in state.registry.all().iter().cloned() {
            set.spawn(each(state.clone(), w));
        }
        while set.join_next().await.is_some() {}
    }
}

async fn health_loop(state: Arc<AppState>) {
    let period = Duration::from_secs_f64(state.cfg.health_check_interval_secs);
    every_worker(state, period, |st, w| async move {
        probe(&st, &w).await;
    })
    .await
}

#[derive(serde::Deserialize)]
struct Load {
    running: u64,
    queued: u64,
}

async fn load_loop(state: Arc<AppState>) {
    let period = Duration::from_secs_f64(state.cfg.load_poll_interval_secs);
    let timeout = Duration::from_secs_f64(state.cfg.load_poll_interval_secs.max(0.2) * 2.0);
    every_worker(state, period, move |st, w| async move {
        let r = get_ok(&st.client, &format!("{}/get_load", w.url), timeout).await;
        let load = r.ok().and_then(|b| serde_json::from_slice::<Load>(&b).ok()).map(|l| l.running + l.queued);
        w.set_reported_load(load);
    })
    .await
}

async fn maintenance_loop(state: Arc<AppState>) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(state.cfg.eviction_interval_secs));
    tick.tick().await;
    loop {
        tick.tick().await;
        for p in state.policies() {
            p.maintenance();
        }
        state.registry.draining();
        state.client.prune();
    }
}

pub fn spawn_background(state: &Arc<AppState>) {
    tokio::spawn(health_loop(state.clone()));
    tokio::spawn(maintenance_loop(state.clone()));
    let cfg = &state.cfg;
    let kinds = if cfg.pd_disaggregation { vec![cfg.prefill_policy(), cfg.decode_policy()] } else { vec![cfg.policy] };
    if kinds.contains(&PolicyKind::PowerOfTwo) {
        tokio::spawn(load_loop(state.clone()));
    }
}
