//! PD (prefill/decode) forwarding. Per attempt: choose a prefill P (prefill policy, on the
//! request text) and a decode D (decode policy), draw a fresh random 63-bit `bootstrap_room`,
//! add `bootstrap_host` (P's host), `bootstrap_port` (P's bootstrap port, null if none was
//! given) and `bootstrap_room` to the JSON body, and send it to P and D at once. For a
//! `/generate` batch (`text`/`input_ids` a list of N prompts) the three fields are lists of N,
//! one fresh room per prompt.
//!
//! The client gets D's answer. P's answer only carries errors: a P failure fails the attempt
//! and drops the D request (closing its connection aborts it at D; D also fails the room by the
//! handshake deadline). The attempt is committed when D's first body byte is forwarded; before
//! that any failure (P or D: connect error, 408/429/5xx) is retried on a new pair with a new
//! room after a backoff; after it a P failure ends the stream with an error.

use crate::body::{PrefillTask, RespBody};
use crate::client;
use crate::error::{upstream_message, Reply, RouterError};
use crate::metrics::route_label;
use crate::proxy::{error_response, pass_through, pick, upstream_error, Outgoing};
use crate::state::AppState;
use crate::text::{batch_size, routing_text};
use crate::worker::{LoadGuard, Role, Worker};
use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::time::Instant as TokioInstant;

fn room() -> u64 {
    fastrand::u64(..) >> 1
}

/// The body sent to both workers of a pair.
pub fn with_bootstrap(body: &Value, path: &str, p: &Worker) -> Result<Bytes, RouterError> {
    let mut obj = body.as_object().cloned().ok_or_else(|| RouterError::BadRequest("request body must be a JSON object".into()))?;
    let port = p.bootstrap_port.map_or(Value::Null, |v| json!(v));
    match batch_size(path, body) {
        Some(n) => {
            obj.insert("bootstrap_host".into(), json!(vec![p.host.clone(); n]));
            obj.insert("bootstrap_port".into(), Value::Array(vec![port; n]));
            obj.insert("bootstrap_room".into(), json!((0..n).map(|_| room()).collect::<Vec<u64>>()));
        }
        None => {
            obj.insert("bootstrap_host".into(), json!(p.host));
            obj.insert("bootstrap_port".into(), port);
            obj.insert("bootstrap_room".into(), json!(room()));
        }
    }
    Ok(Bytes::from(serde_json::to_vec(&Value::Object(obj)).map_err(|e| RouterError::Internal(e.to_string()))?))
}

/// P's side of one attempt: Ok when P answered with success (its body is drained).
async fn prefill_call(state: Arc<AppState>, p: Arc<Worker>, guard: LoadGuard, url: String, out_headers: http::HeaderMap, request_id: String, body: Bytes) -> Result<(), RouterError> {
    let _guard = guard;
    let fail = |status: u16, message: String, reply: Option<Reply>| RouterError::Prefill { worker: p.url.to_string(), status, message, reply };
    let resp = match client::send(&state.client, http::Method::POST, &url, &out_headers, &request_id, body).await {
        Ok(r) => r,
        Err(e) => {
            p.breaker.record(false);
            return Err(fail(502, e.to_string(), None));
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let (msg, reply) = match client::read_body(resp.into_body(), 64 << 10).await {
            Ok(b) => (upstream_message(&b), Reply::parse(&b)),
            Err(e) => (e.to_string(), None),
        };
        let e = fail(status.as_u16(), msg, reply);
        p.breaker.record(!e.is_worker_fault());
        return Err(e);
    }
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        if let Err(e) = frame {
            p.breaker.record(false);
            return Err(fail(502, format!("prefill response broke: {e}"), None));
        }
    }
    p.breaker.record(true);
    Ok(())
}

enum Attempt {
    Done(Response<RespBody>),
    Failed(RouterError),
}

async fn attempt(state: &Arc<AppState>, out: &mut Outgoing, p: Arc<Worker>, d: Arc<Worker>, deadline: TokioInstant) -> Attempt {
    let json = out.json.as_ref().expect("PD requests are parsed JSON");
    let body = match with_bootstrap(json, &out.path, &p) {
        Ok(b) => b,
        Err(e) => return Attempt::Done(error_response(&e)),
    };
    let (pg, dg) = (LoadGuard::new(&p), LoadGuard::new(&d));
    let p_url = format!("{}{}", p.url, out.path_and_query);
    let mut ptask = PrefillTask::spawn(prefill_call(state.clone(), p.clone(), pg, p_url, out.headers.clone(), out.request_id.clone(), body.clone()));
    let d_url = format!("{}{}", d.url, out.path_and_query);
    let (headers, request_id) = (out.headers.clone(), out.request_id.clone());
    let d_send = client::send(&state.client, out.method.clone(), &d_url, &headers, &request_id, body);
    tokio::pin!(d_send);
    let mut p_done = false;
    // Phase 1: D's response head, while watching P.
    let resp = loop {
        tokio::select! {
            r = &mut ptask, if !p_done => match r {
                Ok(Ok(())) => p_done = true,
                Ok(Err(e)) => return Attempt::Failed(e),
                Err(e) => return Attempt::Failed(RouterError::Internal(format!("prefill task: {e}"))),
            },
            r = &mut d_send => match r {
                Ok(resp) => break resp,
                Err(e) => {
                    d.breaker.record(false);
                    return Attempt::Failed(e);
                }
            },
            _ = d.liveness.stalled() => return Attempt::Failed(RouterError::Stalled(state.cfg.stall_timeout_secs)),
            _ = p.liveness.stalled(), if !p_done => return Attempt::Failed(RouterError::Stalled(state.cfg.stall_timeout_secs)),
            _ = tokio::time::sleep_until(deadline) => {
                return Attempt::Failed(RouterError::Timeout(state.cfg.request_timeout_secs));
            }
        }
    };
    if !resp.status().is_success() {
        let e = upstream_error(&d, resp).await;
        d.breaker.record(!e.is_worker_fault());
        if e.retryable() {
            return Attempt::Failed(e);
        }
        return Attempt::Done(error_response(&e));
    }
    // Phase 2: D's first body frame (the commit point), still watching P.
    let (parts, mut dbody) = resp.into_parts();
    let first: Option<Bytes> = loop {
        tokio::select! {
            r = &mut ptask, if !p_done => match r {
                Ok(Ok(())) => p_done = true,
                Ok(Err(e)) => return Attempt::Failed(e),
                Err(e) => return Attempt::Failed(RouterError::Internal(format!("prefill task: {e}"))),
            },
            f = dbody.frame() => match f {
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) if data.is_empty() => continue,
                    Ok(data) => break Some(data),
                    Err(_) => continue,
                },
                Some(Err(e)) => {
                    d.breaker.record(false);
                    return Attempt::Failed(RouterError::Upstream { worker: d.url.to_string(), status: 502, message: format!("decode stream broke: {e}"), reply: None });
                }
                None => break None,
            },
            _ = tokio::time::sleep_until(deadline) => {
                return Attempt::Failed(RouterError::Timeout(state.cfg.request_timeout_secs));
            }
        }
    };
    d.breaker.record(true);
    let resp = Response::from_parts(parts, dbody);
    let prefill = if p_done { None } else { Some(ptask) };
    Attempt::Done(pass_through(state, out, resp, first, vec![dg], prefill, deadline))
}

pub async fn forward_pd(state: &Arc<AppState>, mut out: Outgoing) -> Response<RespBody> {
    let route = route_label(&out.path);
    if !out.json.as_ref().is_some_and(Value::is_object) {
        return error_response(&RouterError::BadRequest("PD requests need a JSON object body".into()));
    }
    let deadline = TokioInstant::now() + std::time::Duration::from_secs_f64(state.cfg.request_timeout_secs);
    let text = match &out.json {
        Some(j) if state.prefill_policy.needs_text() || state.decode_policy.needs_text() => Some(routing_text(&out.path, j)),
        _ => None,
    };
    let (mut tried_p, mut tried_d): (Vec<Arc<str>>, Vec<Arc<str>>) = (Vec::new(), Vec::new());
    let mut last = None;
    for n in 0..=state.cfg.max_retries {
        if n > 0 {
            state.metrics.retry(route);
            tokio::time::sleep(state.backoff.delay(n - 1)).await;
        }
        let Some((p, _)) = pick(state, state.registry.available(Role::Prefill), &tried_p, Some(&*state.prefill_policy), text.as_deref()) else {
            last.get_or_insert(RouterError::NoWorker("prefill"));
            break;
        };
        let Some((d, _)) = pick(state, state.registry.available(Role::Decode), &tried_d, Some(&*state.decode_policy), text.as_deref()) else {
            last.get_or_insert(RouterError::NoWorker("decode"));
            break;
        };
        tried_p.push(p.url.clone());
        tried_d.push(d.url.clone());
        match attempt(state, &mut out, p.clone(), d.clone(), deadline).await {
            Attempt::Done(r) => {
                state.metrics.request(route, &d.url, r.status().as_u16());
                state.metrics.duration(route, out.started.elapsed().as_secs_f64());
                return r;
            }
            Attempt::Failed(e) => {
                let blame = if matches!(e, RouterError::Prefill { .. }) { &p.url } else { &d.url };
                if matches!(e, RouterError::Prefill { .. }) {
                    state.metrics.prefill_failure();
                }
                state.metrics.request(route, blame, e.status().as_u16());
                tracing::warn!(request_id = %out.request_id, prefill = %p.url, decode = %d.url, attempt = n, error = %e, "PD attempt failed");
                if matches!(e, RouterError::Timeout(_)) {
                    state.metrics.rejected("timeout");
                    return error_response(&e);
                }
                let retry = e.retryable();
                last = Some(e);
                if !retry {
                    break;
                }
            }
        }
    }
    let e = last.unwrap_or(RouterError::NoWorker("prefill"));
    if matches!(e, RouterError::NoWorker(_)) {
        state.metrics.rejected("no_worker");
    }
    error_response(&e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::BreakerConfig;
    use std::time::Duration;

    #[test]
    fn the_body_sent_to_a_pair_keeps_the_clients_key_order() {
        // A JSON schema's property order is the order of the keys in the output it constrains.
        let text = r#"{"model":"m","response_format":{"type":"json_schema","json_schema":{"name":"r","schema":{"type":"object","properties":{"zeta":{"type":"integer"},"alpha":{"type":"string"}}}}}}"#;
        let body: Value = serde_json::from_str(text).unwrap();
        let breaker = BreakerConfig { failure_threshold: 3, success_threshold: 1, open_for: Duration::from_secs(1) };
        let p = Worker::new("http://127.0.0.1:1", Role::Prefill, Some(2), breaker, true);
        let sent = with_bootstrap(&body, "/v1/chat/completions", &p).unwrap();
        let sent = std::str::from_utf8(&sent).unwrap();
        assert!(sent.starts_with(&text[..text.len() - 1]), "{sent}");
        assert!(sent.find("\"zeta\"").unwrap() < sent.find("\"alpha\"").unwrap());
    }
}
