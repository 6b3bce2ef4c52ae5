//! Router-level endpoints: `/workers` (list, add, remove), `/flush_cache` (fanned out),
//! `/metrics`, `/health`, `/readiness`, `/health_generate`.

use crate::body::{full, RespBody};
use crate::client::{read_body, send};
use crate::error::RouterError;
use crate::health::probe;
use crate::proxy::error_response;
use crate::state::AppState;
use crate::worker::{Role, Worker};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

pub fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    let mut r = Response::new(full(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn describe(w: &Worker, state: &str) -> Value {
    json!({
        "url": &*w.url, "role": w.role.as_str(), "bootstrap_port": w.bootstrap_port,
        "healthy": w.is_healthy(), "load": w.load(), "reported_load": w.reported_load(),
        "circuit": w.breaker.state().as_str(), "state": state,
    })
}

pub fn list_workers(state: &AppState) -> Response<RespBody> {
    let mut v: Vec<Value> = state.registry.all().iter().map(|w| describe(w, "active")).collect();
    v.extend(state.registry.draining().iter().map(|w| describe(w, "draining")));
    json_response(StatusCode::OK, &json!({"workers": v}))
}

/// The roles this router's mode accepts.
fn role_for(state: &AppState, role: Option<&str>) -> Result<Role, RouterError> {
    let pd = state.cfg.pd_disaggregation;
    match (pd, role.map(Role::parse)) {
        (_, Some(None)) => Err(RouterError::BadRequest("role must be regular, prefill or decode".into())),
        (false, None) | (false, Some(Some(Role::Regular))) => Ok(Role::Regular),
        (false, Some(Some(_))) => Err(RouterError::BadRequest("prefill/decode workers need a router started with --pd-disaggregation".into())),
        (true, Some(Some(r))) if r != Role::Regular => Ok(r),
        (true, _) => Err(RouterError::BadRequest("in PD mode give \"role\": \"prefill\" or \"decode\"".into())),
    }
}

/// Registers a worker and probes it once right away; used by POST /workers and discovery.
pub async fn add_worker(state: &AppState, url: &str, role: Role, bootstrap_port: Option<u16>) -> Result<Arc<Worker>, RouterError> {
    crate::config::RouterConfig { worker_urls: vec![url.to_string()], ..Default::default() }
        .validate()
        .map_err(|e| RouterError::BadRequest(e.to_string()))?;
    let w = state.registry.add(url, role, bootstrap_port, false)?;
    probe(state, &w).await;
    Ok(w)
}

pub fn remove_worker(state: &AppState, url: &str) -> Option<Arc<Worker>> {
    let w = state.registry.remove(url)?;
    state.forget(&w);
    Some(w)
}

pub async fn post_worker(state: &AppState, body: &[u8]) -> Response<RespBody> {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return error_response(&RouterError::bad_json(&e)),
    };
    let Some(url) = v.get("url").and_then(Value::as_str) else {
        return error_response(&RouterError::BadRequest("POST /workers needs {\"url\": \"http://host:port\"}".into()));
    };
    // "worker_type" is SGLang's router's name for the same field
    let role = match role_for(state, v.get("role").or_else(|| v.get("worker_type")).and_then(Value::as_str)) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    let port = match v.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(p) => match p.as_u64().and_then(|p| u16::try_from(p).ok()) {
            Some(p) => Some(p),
            None => return error_response(&RouterError::BadRequest("bootstrap_port must be a port number".into())),
        },
    };
    // Admitted on a good first probe (200); otherwise registered but not routed to until a health check passes
    // (202, saying so), so a worker that is still starting can be added before it is up.
    match add_worker(state, url, role, port).await {
        Ok(w) if w.is_healthy() => json_response(StatusCode::OK, &json!({"added": describe(&w, "active")})),
        Ok(w) => json_response(
            StatusCode::ACCEPTED,
            &json!({"added": describe(&w, "active"),
                    "message": "registered, but its first health probe failed: no request goes there until a health check passes"}),
        ),
        Err(e) => error_response(&e),
    }
}

pub fn delete_worker(state: &AppState, query: Option<&str>, body: &[u8]) -> Response<RespBody> {
    let from_query = query.and_then(|q| {
        q.split('&').find_map(|kv| kv.strip_prefix("url=")).map(|u| percent_decode(u))
    });
    let from_body = serde_json::from_slice::<Value>(body).ok().and_then(|v| v.get("url").and_then(Value::as_str).map(String::from));
    let Some(url) = from_query.or(from_body) else {
        return error_response(&RouterError::BadRequest("DELETE /workers needs ?url=... or {\"url\": ...}".into()));
    };
    match remove_worker(state, &url) {
        Some(w) => json_response(StatusCode::OK, &json!({"removed": &*w.url, "draining": w.load()})),
        None => error_response(&RouterError::BadRequest(format!("no worker {url} is registered"))),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// POST /flush_cache to every worker; the policies forget their prefix trees too.
pub async fn flush_cache(state: &Arc<AppState>, headers: &HeaderMap, request_id: &str) -> Response<RespBody> {
    for p in state.policies() {
        p.reset();
    }
    let mut set = tokio::task::JoinSet::new();
    for w in state.registry.all().iter().cloned() {
        let (st, h, rid) = (state.clone(), headers.clone(), request_id.to_string());
        set.spawn(async move {
            let url = format!("{}/flush_cache", w.url);
            let r = tokio::time::timeout(Duration::from_secs(30), send(&st.client, Method::POST, &url, &h, &rid, Bytes::new())).await;
            let res = match r {
                Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
                Ok(Ok(resp)) => Err(format!("status {}", resp.status())),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer within 30s".to_string()),
            };
            (w.url.to_string(), res)
        });
    }
    let (mut ok, mut failed) = (Vec::new(), serde_json::Map::new());
    while let Some(Ok((url, r))) = set.join_next().await {
        match r {
            Ok(()) => ok.push(Value::String(url)),
            Err(e) => {
                failed.insert(url, Value::String(e));
            }
        }
    }
    let status = if failed.is_empty() { StatusCode::OK } else { StatusCode::BAD_GATEWAY };
    json_response(status, &json!({"flushed": ok, "failed": failed}))
}

pub fn readiness(state: &AppState) -> Response<RespBody> {
    let ready = if state.cfg.pd_disaggregation {
        !state.registry.available(Role::Prefill).is_empty() && !state.registry.available(Role::Decode).is_empty()
    } else {
        !state.registry.available(Role::Regular).is_empty()
    };
    let n = state.registry.all().iter().filter(|w| w.is_available()).count();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    json_response(status, &json!({"ready": ready, "available_workers": n}))
}

/// GET /health_generate on one available worker of each role the mode uses.
pub async fn health_generate(state: &Arc<AppState>, request_id: &str) -> Response<RespBody> {
    let roles: &[Role] = if state.cfg.pd_disaggregation { &[Role::Prefill, Role::Decode] } else { &[Role::Regular] };
    let mut checked = Vec::new();
    for &role in roles {
        let avail = state.registry.available(role);
        let Some(w) = avail.get(fastrand::usize(..avail.len().max(1))).cloned() else {
            return error_response(&RouterError::NoWorker(role.as_str()));
        };
        let url = format!("{}/health_generate", w.url);
        let r = tokio::time::timeout(Duration::from_secs(60), send(&state.client, Method::GET, &url, &HeaderMap::new(), request_id, Bytes::new())).await;
        match r {
            Ok(Ok(resp)) if resp.status().is_success() => {
                let _ = read_body(resp.into_body(), 1 << 20).await;
                checked.push(Value::String(w.url.to_string()));
            }
            Ok(Ok(resp)) => {
                let status = resp.status().as_u16();
                let body = read_body(resp.into_body(), 1 << 16).await.unwrap_or_default();
                let e = RouterError::Upstream { worker: w.url.to_string(), status, message: crate::error::upstream_message(&body), reply: crate::error::Reply::parse(&body) };
                return error_response(&e);
            }
            Ok(Err(e)) => return error_response(&e),
            Err(_) => return error_response(&RouterError::Timeout(60.0)),
        }
    }
    json_response(StatusCode::OK, &json!({"status": "ok", "workers": checked}))
}

pub fn metrics(state: &AppState) -> Response<RespBody> {
    let mut r = Response::new(full(state.metrics.render(&state.gauges(), state.limiter.as_ref().map_or(0, |l| l.queued()))));
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn percent_decoding_of_urls() {
        assert_eq!(super::percent_decode("http%3A%2F%2F127.0.0.1%3A9000"), "http://127.0.0.1:9000");
        assert_eq!(super::percent_decode("http://a:1"), "http://a:1");
    }
}
