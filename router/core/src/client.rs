//! The pooled HTTP/1.1 client the router uses to reach workers (keep-alive, TCP_NODELAY).

use crate::error::RouterError;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn build() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_keepalive(Some(Duration::from_secs(30)));
    conn.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(4096)
        .build(conn)
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

/// Sends `body` to `url` (worker base URL + path and query), forwarding end-to-end headers.
pub async fn send(
    client: &HttpClient,
    method: Method,
    url: &str,
    headers: &HeaderMap,
    request_id: &str,
    body: Bytes,
) -> Result<Response<Incoming>, RouterError> {
    let mut req = Request::builder().method(method).uri(url);
    let h = req.headers_mut().expect("builder has no error yet");
    for (k, v) in headers {
        if !is_hop_by_hop(k) && k != REQUEST_ID {
            h.append(k, v.clone());
        }
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
    client.request(req).await.map_err(|e| {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        RouterError::Connect { worker: url.to_string(), message: msg }
    })
}

/// Reads a whole (small) worker body, at most `limit` bytes.
pub async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, String> {
    Limited::new(body, limit).collect().await.map(|c| c.to_bytes()).map_err(|e| e.to_string())
}

/// GET `url` with a deadline; the body if the status was 2xx.
pub async fn get_ok(client: &HttpClient, url: &str, timeout: Duration) -> Result<Bytes, String> {
    let fut = async {
        let resp = send(client, Method::GET, url, &HeaderMap::new(), "router-probe", Bytes::new())
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = read_body(resp.into_body(), 1 << 20).await?;
        if status.is_success() {
            Ok(body)
        } else {
            Err(format!("status {status}"))
        }
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| format!("no answer within {timeout:?}"))?
}
