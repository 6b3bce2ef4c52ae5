//! Kubernetes service discovery: for each role, list the pods matching its label selector,
//! then watch them (`watch=true` from the list's resourceVersion), re-listing at least every
//! --discovery-relist-interval-secs. Only Ready pods (phase Running, condition Ready=True, an
//! IP, not being deleted) are routable; pods that are deleted or lose readiness are removed
//! (their in-flight requests drain). Prefill pods carry their bootstrap port in the annotation
//! --bootstrap-port-annotation. Workers found this way are `http://<pod IP>:<--service-discovery-port>`.
//!
//! The API server is reached over plain HTTP (--k8s-api-url, default http://127.0.0.1:8001, i.e.
//! a `kubectl proxy` sidecar), with the pod's service-account token when one is mounted.
//! No cluster can run where this was developed: it is tested against a small fake API server
//! that serves pod lists and watch events (tests/router/fake_k8s_api.py).

use crate::admin::{add_worker, remove_worker};
use crate::client::{read_body, send, HttpClient};
use crate::state::AppState;
use crate::worker::Role;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method};
use http_body_util::BodyExt;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

#[derive(Debug, Clone, PartialEq)]
struct PodWorker {
    url: String,
    bootstrap_port: Option<u16>,
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The worker a pod stands for, if it is routable now.
fn pod_worker(state: &AppState, role: Role, pod: &Value) -> Option<PodWorker> {
    if pod.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null()) {
        return None;
    }
    if pod.pointer("/status/phase").and_then(Value::as_str) != Some("Running") {
        return None;
    }
    let ready = pod.pointer("/status/conditions").and_then(Value::as_array).is_some_and(|cs| {
        cs.iter().any(|c| c.get("type").and_then(Value::as_str) == Some("Ready") && c.get("status").and_then(Value::as_str) == Some("True"))
    });
    let ip = pod.pointer("/status/podIP").and_then(Value::as_str).filter(|s| !s.is_empty())?;
    if !ready {
        return None;
    }
    let bootstrap_port = if role == Role::Prefill {
        pod.pointer("/metadata/annotations")
            .and_then(|a| a.get(&state.cfg.bootstrap_port_annotation))
            .and_then(Value::as_str)
            .and_then(|p| p.parse().ok())
    } else {
        None
    };
    let host = if ip.contains(':') { format!("[{ip}]") } else { ip.to_string() };
    Some(PodWorker { url: format!("http://{host}:{}", state.cfg.service_discovery_port), bootstrap_port })
}

fn pod_name(pod: &Value) -> Option<String> {
    pod.pointer("/metadata/name").and_then(Value::as_str).map(String::from)
}

/// Why a list or watch of the API server failed (the watcher logs it and starts over).
#[derive(Debug, thiserror::Error)]
enum DiscoveryError {
    #[error("{0}")]
    Request(#[from] crate::error::RouterError),
    #[error(transparent)]
    Body(#[from] crate::client::BodyError),
    #[error("{what} answered {status}: {body}")]
    Status { what: &'static str, status: http::StatusCode, body: String },
    #[error("pod list is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("watch stream broke: {0}")]
    Stream(String),
    #[error("watch error event: {0}")]
    Event(String),
}

struct Watcher {
    state: Arc<AppState>,
    /// Its own connections to the API server, without the workers' key.
    client: HttpClient,
    role: Role,
    base: String,
    headers: HeaderMap,
    known: HashMap<String, PodWorker>,
}

impl Watcher {
    async fn apply(&mut self, name: &str, want: Option<PodWorker>) {
        let have = self.known.get(name).cloned();
        if have == want {
            return;
        }
        if let Some(old) = have {
            remove_worker(&self.state, &old.url);
            self.known.remove(name);
            tracing::info!(pod = name, worker = %old.url, "discovery: pod gone or not ready; worker removed");
        }
        if let Some(new) = want {
            match add_worker(&self.state, &new.url, self.role, new.bootstrap_port).await {
                Ok(_) => tracing::info!(pod = name, worker = %new.url, role = self.role.as_str(), "discovery: worker added"),
                Err(e) => tracing::warn!(pod = name, worker = %new.url, error = %e, "discovery: cannot add worker"),
            }
            self.known.insert(name.to_string(), new);
        }
    }

    /// Lists pods, reconciles, and returns the list's resourceVersion.
    async fn relist(&mut self) -> Result<String, DiscoveryError> {
        let resp = send(&self.client, Method::GET, &self.base, &self.headers, "discovery", Bytes::new()).await?;
        let status = resp.status();
        let body = read_body(resp.into_body(), 64 << 20).await?;
        if !status.is_success() {
            return Err(DiscoveryError::Status { what: "pod list", status, body: String::from_utf8_lossy(&body).into() });
        }
        let v: Value = serde_json::from_slice(&body)?;
        let mut seen: HashMap<String, Option<PodWorker>> = HashMap::new();
        for pod in v.get("items").and_then(Value::as_array).into_iter().flatten() {
            if let Some(name) = pod_name(pod) {
                seen.insert(name, pod_worker(&self.state, self.role, pod));
            }
        }
        let gone: Vec<String> = self.known.keys().filter(|k| !seen.contains_key(*k)).cloned().collect();
        for name in gone {
            self.apply(&name, None).await;
        }
        for (name, w) in seen {
            self.apply(&name, w).await;
        }
        Ok(v.pointer("/metadata/resourceVersion").and_then(Value::as_str).unwrap_or("").to_string())
    }

    async fn watch(&mut self, rv: &str, secs: u64) -> Result<(), DiscoveryError> {
        let url = format!("{}&watch=true&resourceVersion={}&timeoutSeconds={secs}", self.base, encode(rv));
        let resp = send(&self.client, Method::GET, &url, &self.headers, "discovery", Bytes::new()).await?;
        if !resp.status().is_success() {
            return Err(DiscoveryError::Status { what: "watch", status: resp.status(), body: String::new() });
        }
        let mut body = resp.into_body();
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| DiscoveryError::Stream(e.to_string()))?;
            let Ok(data) = frame.into_data() else { continue };
            buf.extend_from_slice(&data);
            while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                let line = buf.split_to(pos + 1);
                let Ok(ev) = serde_json::from_slice::<Value>(&line[..pos]) else { continue };
                let kind = ev.get("type").and_then(Value::as_str).unwrap_or("");
                let Some(pod) = ev.get("object") else { continue };
                if kind == "ERROR" {
                    return Err(DiscoveryError::Event(pod.to_string()));
                }
                let Some(name) = pod_name(pod) else { continue };
                let want = if kind == "DELETED" { None } else { pod_worker(&self.state, self.role, pod) };
                self.apply(&name, want).await;
            }
        }
        Ok(())
    }

    async fn run(mut self) {
        let relist = Duration::from_secs_f64(self.state.cfg.discovery_relist_interval_secs);
        loop {
            match self.relist().await {
                Ok(rv) => {
                    let secs = relist.as_secs().max(1);
                    match tokio::time::timeout(relist, self.watch(&rv, secs)).await {
                        Ok(Err(e)) => tracing::warn!(role = self.role.as_str(), error = %e, "discovery watch ended"),
                        Ok(Ok(())) | Err(_) => {}
                    }
                }
                Err(e) => {
                    tracing::warn!(role = self.role.as_str(), error = %e, "discovery list failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}

pub fn spawn(state: &Arc<AppState>) {
    let cfg = &state.cfg;
    let api = cfg.k8s_api_url.clone().unwrap_or_else(|| "http://127.0.0.1:8001".into());
    let api = api.trim_end_matches('/').to_string();
    let mut headers = HeaderMap::new();
    if let Ok(tok) = std::fs::read_to_string(TOKEN_FILE) {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", tok.trim())) {
            headers.insert(http::header::AUTHORIZATION, v);
        }
    }
    let targets = if cfg.pd_disaggregation {
        vec![(Role::Prefill, &cfg.prefill_selector), (Role::Decode, &cfg.decode_selector)]
    } else {
        vec![(Role::Regular, &cfg.selector)]
    };
    for (role, sel) in targets {
        let base = format!("{api}/api/v1/namespaces/{}/pods?labelSelector={}", encode(&cfg.service_discovery_namespace), encode(&sel.join(",")));
        let w = Watcher { state: state.clone(), client: crate::client::build(None), role, base, headers: headers.clone(), known: HashMap::new() };
        tracing::info!(role = role.as_str(), url = %w.base, "service discovery started");
        tokio::spawn(w.run());
    }
}
