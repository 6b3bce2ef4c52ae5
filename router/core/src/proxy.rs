//! Regular-mode forwarding: pick a worker, send, and pass the answer through. Failed attempts
//! (connection errors, 408/429/5xx) are retried on another worker with backoff — only before
//! the response head went to the client, which is the first byte it sees.

use crate::body::{full, ProxyBody, RespBody};
use crate::client::{self, is_hop_by_hop, REQUEST_ID};
use crate::error::{upstream_message, Reply, RouterError};
use crate::metrics::route_label;
use crate::policies::{Choice, Policy, RouteRequest};
use crate::state::AppState;
use crate::worker::{LoadGuard, Role, Worker};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use crate::upstream::UpBody;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant as TokioInstant;

/// Everything about an incoming request the forwarding code needs.
pub struct Outgoing {
    pub method: Method,
    pub path: String,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub request_id: String,
    pub body: Bytes,
    pub json: Option<serde_json::Value>,
    pub permit: Option<OwnedSemaphorePermit>,
    pub started: Instant,
}

impl Outgoing {
    pub fn is_stream(&self) -> bool {
        self.json.as_ref().and_then(|j| j.get("stream")).and_then(|s| s.as_bool()).unwrap_or(false)
    }
}

/// An error as a JSON response.
pub fn error_response(e: &RouterError) -> Response<RespBody> {
    let mut r = Response::new(full(e.body()));
    *r.status_mut() = e.status();
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let RouterError::MethodNotAllowed { allow, .. } = e {
        r.headers_mut().insert(http::header::ALLOW, HeaderValue::from_static(allow));
    }
    r
}

/// Picks among `avail`, preferring workers not tried yet by this request.
pub fn pick(
    state: &AppState,
    avail: Vec<Arc<Worker>>,
    tried: &[Arc<str>],
    policy: Option<&dyn Policy>,
    text: Option<&[u8]>,
) -> Option<(Arc<Worker>, Choice)> {
    let fresh: Vec<Arc<Worker>> = avail.iter().filter(|w| !tried.contains(&w.url)).cloned().collect();
    let pool = if fresh.is_empty() { avail } else { fresh };
    let t0 = Instant::now();
    let choice = match policy {
        Some(p) => p.select(&pool, &RouteRequest { text })?,
        None => Choice { index: fastrand::usize(..pool.len().max(1)), match_ratio: None },
    };
    let w = pool.get(choice.index)?.clone();
    state.metrics.decision.observe(t0.elapsed().as_secs_f64());
    if let Some(r) = choice.match_ratio {
        state.metrics.match_ratio.observe(r);
    }
    Some((w, choice))
}

/// Turns a worker's non-success answer into an error (reading its message).
pub async fn upstream_error(worker: &Worker, resp: Response<UpBody>) -> RouterError {
    let status = resp.status().as_u16();
    let (message, reply) = match client::read_body(resp.into_body(), 64 << 10).await {
        Ok(b) => (upstream_message(&b), Reply::parse(&b)),
        Err(e) => (e.to_string(), None),
    };
    RouterError::Upstream { worker: worker.url.to_string(), status, message, reply }
}

/// The client's response: the worker's status and headers, its body streamed through.
pub fn pass_through(state: &AppState, out: &mut Outgoing, resp: Response<UpBody>, first: Option<Bytes>, guards: Vec<LoadGuard>, prefill: Option<crate::body::PrefillTask>, deadline: TokioInstant) -> Response<RespBody> {
    let (parts, inner) = resp.into_parts();
    let sse = out.is_stream()
        || parts.headers.get(http::header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let body = ProxyBody {
        first,
        inner: Some(inner),
        prefill,
        guards,
        permit: out.permit.take(),
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        timeout_secs: state.cfg.request_timeout_secs,
        stall: sse.then(|| Box::pin(tokio::time::sleep(std::time::Duration::from_secs_f64(state.cfg.stall_timeout_secs)))),
        stall_secs: state.cfg.stall_timeout_secs,
        sse,
        request_id: out.request_id.clone(),
    };
    let mut r = Response::new(http_body_util::BodyExt::boxed(body));
    *r.status_mut() = parts.status;
    for (k, v) in &parts.headers {
        if !is_hop_by_hop(k) && k != REQUEST_ID {
            r.headers_mut().append(k, v.clone());
        }
    }
    r
}

/// Forwards to one worker of `role` chosen by `policy` (None: any), with retries.
pub async fn forward(state: &Arc<AppState>, role: Role, policy: Option<&dyn Policy>, mut out: Outgoing) -> Response<RespBody> {
    let route = route_label(&out.path);
    let deadline = TokioInstant::now() + std::time::Duration::from_secs_f64(state.cfg.request_timeout_secs);
    let text: Option<Vec<u8>> = match (policy, &out.json) {
        (Some(p), Some(j)) if p.needs_text() => Some(crate::text::routing_text(&out.path, j)),
        _ => None,
    };
    let mut tried: Vec<Arc<str>> = Vec::new();
    let mut last: Option<RouterError> = None;
    for attempt in 0..=state.cfg.max_retries {
        if attempt > 0 {
            state.metrics.retry(route);
            tokio::time::sleep(state.backoff.delay(attempt - 1)).await;
        }
        let Some((w, _)) = pick(state, state.registry.available(role), &tried, policy, text.as_deref()) else {
            break;
        };
        tried.push(w.url.clone());
        let guard = LoadGuard::new(&w);
        let url = format!("{}{}", w.url, out.path_and_query);
        let sent = client::send(&state.client, out.method.clone(), &url, &out.headers, &out.request_id, out.body.clone());
        let resp = tokio::select! {
            r = sent => r,
            _ = w.liveness.stalled() => Err(RouterError::Stalled(state.cfg.stall_timeout_secs)),
            _ = tokio::time::sleep_until(deadline) => {
                let e = RouterError::Timeout(state.cfg.request_timeout_secs);
                state.metrics.request(route, &w.url, e.status().as_u16());
                state.metrics.rejected("timeout");
                return error_response(&e);
            }
        };
        let err = match resp {
            Ok(resp) if resp.status().is_server_error() || resp.status() == StatusCode::TOO_MANY_REQUESTS || resp.status() == StatusCode::REQUEST_TIMEOUT => {
                upstream_error(&w, resp).await
            }
            Ok(resp) => {
                w.breaker.record(true);
                state.metrics.request(route, &w.url, resp.status().as_u16());
                state.metrics.duration(route, out.started.elapsed().as_secs_f64());
                tracing::debug!(request_id = %out.request_id, worker = %w.url, status = resp.status().as_u16(), "forwarded");
                return pass_through(state, &mut out, resp, None, vec![guard], None, deadline);
            }
            Err(e) => e,
        };
        w.breaker.record(!err.is_worker_fault());
        state.metrics.request(route, &w.url, err.status().as_u16());
        tracing::warn!(request_id = %out.request_id, worker = %w.url, attempt, error = %err, "attempt failed");
        let retry = err.retryable();
        last = Some(err);
        if !retry {
            break;
        }
    }
    let e = last.unwrap_or(RouterError::NoWorker(role.as_str()));
    if matches!(e, RouterError::NoWorker(_)) {
        state.metrics.rejected("no_worker");
    }
    error_response(&e)
}
