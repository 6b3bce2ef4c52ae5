//! The HTTP front door: accept loop (TCP_NODELAY), request ids, API key, body limit, the
//! concurrency limiter, dispatch by path, and graceful shutdown on SIGTERM/SIGINT (stop
//! accepting, let in-flight requests finish for up to --shutdown-grace-period-secs).

use crate::admin;
use crate::body::RespBody;
use crate::client::REQUEST_ID;
use crate::error::RouterError;
use crate::pd::forward_pd;
use crate::proxy::{error_response, forward, Outgoing};
use crate::state::AppState;
use crate::worker::Role;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

fn new_request_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

fn authorized(state: &AppState, req: &Request<Incoming>) -> bool {
    let Some(key) = &state.cfg.api_key else { return true };
    let Some(v) = req.headers().get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let Some(token) = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")) else { return false };
    // Constant-time comparison.
    let (a, b) = (token.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn read_limited(state: &AppState, body: Incoming) -> Result<Bytes, RouterError> {
    let limit = state.cfg.max_payload_size;
    if body.size_hint().lower() > limit as u64 {
        return Err(RouterError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(RouterError::PayloadTooLarge { limit }),
        Err(e) => Err(RouterError::BadRequest(format!("could not read the request body: {e}"))),
    }
}

const INFERENCE: [&str; 3] = ["/generate", "/v1/completions", "/v1/chat/completions"];
const INFO: [&str; 5] = ["/v1/models", "/get_model_info", "/get_server_info", "/model_info", "/openapi.json"];

async fn inference(state: &Arc<AppState>, req: Request<Incoming>, request_id: String, started: Instant) -> Result<Response<RespBody>, RouterError> {
    let (parts, body) = req.into_parts();
    let bytes = read_limited(state, body).await?;
    let path = parts.uri.path().to_string();
    let pd = state.cfg.pd_disaggregation;
    let json = if pd || state.policy.needs_text() {
        Some(serde_json::from_slice::<serde_json::Value>(&bytes).map_err(|e| RouterError::bad_json(&e))?)
    } else {
        None
    };
    let permit = match &state.limiter {
        Some(l) => Some(l.acquire().await.inspect_err(|e| {
            state.metrics.rejected(if matches!(e, RouterError::QueueFull(_)) { "queue_full" } else { "queue_timeout" });
        })?),
        None => None,
    };
    let out = Outgoing {
        method: parts.method,
        path_and_query: parts.uri.path_and_query().map_or(path.clone(), |p| p.to_string()),
        path,
        headers: parts.headers,
        request_id,
        body: bytes,
        json,
        permit,
        started,
    };
    Ok(if pd { forward_pd(state, out).await } else { forward(state, Role::Regular, Some(&*state.policy), out).await })
}

/// Paths answered by any one worker (a prefill worker in PD mode), body passed through: model info, and the
/// tokenizer endpoints, which every worker answers alike.
const TOKENIZE: [&str; 2] = ["/tokenize", "/detokenize"];

/// The methods each known path takes, for a 405's `Allow` header.
fn allowed_methods(path: &str) -> Option<&'static str> {
    match path {
        p if INFERENCE.contains(&p) || TOKENIZE.contains(&p) || p == "/flush_cache" => Some("POST"),
        p if INFO.contains(&p) || p.starts_with("/v1/models/") => Some("GET"),
        "/health_generate" | "/metrics" => Some("GET"),
        "/workers" => Some("GET, POST, DELETE"),
        _ => None,
    }
}

async fn info(state: &Arc<AppState>, req: Request<Incoming>, request_id: String, started: Instant) -> Result<Response<RespBody>, RouterError> {
    let (parts, body) = req.into_parts();
    let body = if parts.method == Method::POST { read_limited(state, body).await? } else { Bytes::new() };
    let role = if state.cfg.pd_disaggregation { Role::Prefill } else { Role::Regular };
    let out = Outgoing {
        method: parts.method,
        path: parts.uri.path().to_string(),
        path_and_query: parts.uri.path_and_query().map_or("/".into(), |p| p.to_string()),
        headers: parts.headers,
        request_id,
        body,
        json: None,
        permit: None,
        started,
    };
    Ok(forward(state, role, None, out).await)
}

/// Bytes of the request line and headers, as they came on the wire (give or take whitespace).
fn head_size(req: &Request<Incoming>) -> usize {
    let target = req.uri().path_and_query().map_or(1, |p| p.as_str().len()) + req.uri().authority().map_or(0, |a| a.as_str().len());
    let line = req.method().as_str().len() + target + 12;
    line + req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum::<usize>()
}

async fn dispatch(state: &Arc<AppState>, req: Request<Incoming>, request_id: String) -> Result<Response<RespBody>, RouterError> {
    let started = Instant::now();
    if head_size(&req) > state.cfg.max_header_size {
        state.metrics.rejected("header");
        return Err(RouterError::HeaderTooLarge { limit: state.cfg.max_header_size });
    }
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if path == "/health" || path == "/liveness" {
        return Ok(admin::json_response(StatusCode::OK, &serde_json::json!({"status": "ok"})));
    }
    if path == "/readiness" {
        return Ok(admin::readiness(state));
    }
    if !authorized(state, &req) {
        state.metrics.rejected("auth");
        return Err(RouterError::Unauthorized);
    }
    if state.shutting_down.load(Ordering::Relaxed) && method == Method::POST {
        return Err(RouterError::ShuttingDown);
    }
    match (method, path.as_str()) {
        (Method::POST, p) if INFERENCE.contains(&p) => inference(state, req, request_id, started).await,
        (Method::GET, p) if INFO.contains(&p) || p.starts_with("/v1/models/") => info(state, req, request_id, started).await,
        (Method::POST, p) if TOKENIZE.contains(&p) => info(state, req, request_id, started).await,
        (Method::GET, "/health_generate") => Ok(admin::health_generate(state, &request_id).await),
        (Method::GET, "/metrics") => Ok(admin::metrics(state)),
        (Method::GET, "/workers") => Ok(admin::list_workers(state)),
        (Method::POST, "/workers") => {
            let b = read_limited(state, req.into_body()).await?;
            Ok(admin::post_worker(state, &b).await)
        }
        (Method::DELETE, "/workers") => {
            let q = req.uri().query().map(String::from);
            let b = read_limited(state, req.into_body()).await?;
            Ok(admin::delete_worker(state, q.as_deref(), &b))
        }
        (Method::POST, "/flush_cache") => Ok(admin::flush_cache(state, req.headers(), &request_id).await),
        (m, p) => match allowed_methods(p) {
            Some(allow) => Err(RouterError::MethodNotAllowed { method: m.to_string(), path: p.to_string(), allow }),
            None => Err(RouterError::NotFound { method: m.to_string(), path: p.to_string() }),
        },
    }
}

async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Result<Response<RespBody>, Infallible> {
    let request_id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(new_request_id, String::from);
    let mut resp = match dispatch(&state, req, request_id.clone()).await {
        Ok(r) => r,
        Err(e) => {
            if matches!(e, RouterError::PayloadTooLarge { .. }) {
                state.metrics.rejected("payload");
            }
            tracing::debug!(request_id = %request_id, error = %e, "request refused");
            error_response(&e)
        }
    };
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    Ok(resp)
}

/// Serves until SIGTERM/SIGINT (or `stop` resolves), then drains connections.
pub async fn serve(state: Arc<AppState>, listener: TcpListener, stop: impl std::future::Future<Output = ()>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.keep_alive(true);
    http.max_buf_size(crate::config::HEAD_BUFFER);
    // No half-closed clients: while a request's answer is pending, hyper keeps reading the
    // client connection and an EOF there ends the connection and drops the request's future,
    // upstream requests included (the workers then abort them). That is how a client that
    // goes away before its first byte is noticed, at no cost per request.
    http.half_close(false);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let st = state.clone();
                let conn = http.serve_connection(TokioIo::new(stream), service_fn(move |req| handle(st.clone(), req)));
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            _ = &mut stop => break,
        }
    }
    drop(listener);
    state.shutting_down.store(true, Ordering::Relaxed);
    let grace = Duration::from_secs_f64(state.cfg.shutdown_grace_period_secs);
    tracing::info!(grace_secs = grace.as_secs_f64(), "shutting down: no new connections, draining in-flight requests");
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => tracing::info!("all connections drained"),
        Err(_) => tracing::warn!("grace period over; closing the remaining connections"),
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::warn!("cannot install signal handlers; stop the router with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
