//! Requests to workers: end-to-end headers, the request id, JSON content type, and the workers' API key when
//! one is set (`--worker-api-key`; it replaces the client's `Authorization`, which then stays at the router);
//! over the keep-alive connections of [`crate::upstream::Pool`] (TCP_NODELAY, driven by the caller).

use crate::error::RouterError;
use crate::upstream::{Pool, PoolConfig, UpBody};
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use std::time::Duration;

pub struct HttpClient {
    pool: Pool,
    worker_auth: Option<HeaderValue>,
}

impl HttpClient {
    /// Drops idle connections the workers closed.
    pub fn prune(&self) {
        self.pool.prune()
    }
}

pub fn build(worker_api_key: Option<&str>) -> HttpClient {
    let worker_auth = worker_api_key.and_then(|k| HeaderValue::from_str(&format!("Bearer {k}")).ok()).map(|mut v| {
        v.set_sensitive(true);
        v
    });
    HttpClient { pool: Pool::new(PoolConfig::default()), worker_auth }
}

/// `http://host:port/prefix` → (`host:port`, `/prefix`); only plain HTTP.
fn split_url(url: &str) -> Result<(&str, &str), RouterError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| RouterError::Connect {
        worker: url.to_string(),
        message: "only http:// worker URLs are supported".into(),
    })?;
    Ok(match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    })
}

/// Headers that belong to one connection and are never forwarded.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "proxy-authenticate" | "proxy-authorization" | "te" | "trailer"
            | "transfer-encoding" | "upgrade" | "host" | "content-length"
    )
}

pub const REQUEST_ID: &str = "x-request-id";

/// Sends `body` to `url` (a worker's base URL + path and query; or another server's, through a client built
/// without a worker key), forwarding end-to-end headers.
pub async fn send(
    client: &HttpClient,
    method: Method,
    url: &str,
    headers: &HeaderMap,
    request_id: &str,
    body: Bytes,
) -> Result<Response<UpBody>, RouterError> {
    let auth = client.worker_auth.as_ref();
    let (authority, path) = split_url(url)?;
    let mut req = Request::builder().method(method).uri(path);
    let h = req.headers_mut().expect("builder has no error yet");
    for (k, v) in headers {
        if !is_hop_by_hop(k) && k != REQUEST_ID && !(auth.is_some() && k == http::header::AUTHORIZATION) {
            h.append(k, v.clone());
        }
    }
    if let Some(v) = auth {
        h.insert(http::header::AUTHORIZATION, v.clone());
    }
    if let Ok(v) = HeaderValue::from_str(authority) {
        h.insert(http::header::HOST, v);
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert(REQUEST_ID, v);
    }
    if !body.is_empty() && !h.contains_key(http::header::CONTENT_TYPE) {
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| RouterError::BadRequest(format!("cannot build a request for {url}: {e}")))?;
    client.pool.request(authority, req).await.map_err(|e| RouterError::Connect { worker: url.to_string(), message: e.to_string() })
}

/// A body that could not be read whole: it broke off, or it passed the limit.
#[derive(Debug, thiserror::Error)]
#[error("could not read the body: {0}")]
pub struct BodyError(String);

/// Reads a whole (small) worker body, at most `limit` bytes.
pub async fn read_body(body: UpBody, limit: usize) -> Result<Bytes, BodyError> {
    Limited::new(body, limit).collect().await.map(|c| c.to_bytes()).map_err(|e| BodyError(e.to_string()))
}

/// Why a probe failed: no answer in time (the worker may be frozen), or an answer that was not a 2xx (or no
/// connection at all).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Failed(String),
}

/// GET `url` with a deadline; the body if the status was 2xx.
pub async fn get_ok(client: &HttpClient, url: &str, timeout: Duration) -> Result<Bytes, ProbeError> {
    let fut = async {
        let resp = send(client, Method::GET, url, &HeaderMap::new(), "router-probe", Bytes::new())
            .await
            .map_err(|e| ProbeError::Failed(e.to_string()))?;
        let status = resp.status();
        let body = read_body(resp.into_body(), 1 << 20).await.map_err(|e| ProbeError::Failed(e.to_string()))?;
        if status.is_success() {
            Ok(body)
        } else {
            Err(ProbeError::Failed(format!("status {status}")))
        }
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| ProbeError::Timeout(timeout))?
}
