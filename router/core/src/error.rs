//! Typed errors and their OpenAI-style JSON rendering `{"error": {"message", "type", "code"}}`.

use bytes::Bytes;
use http::StatusCode;

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("missing or invalid API key; send `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("request body is larger than --max-payload-size ({limit} bytes)")]
    PayloadTooLarge { limit: usize },
    #[error("request body is not valid JSON: {0}")]
    BadJson(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("too many requests: the router's queue is full (--queue-size {0})")]
    QueueFull(usize),
    #[error("request waited longer than --queue-timeout-secs ({0}s) for a slot")]
    QueueTimeout(f64),
    #[error("request did not finish within --request-timeout-secs ({0}s)")]
    Timeout(f64),
    #[error("no healthy {0} worker is available")]
    NoWorker(&'static str),
    #[error("worker {worker} failed: {message}")]
    Upstream { worker: String, status: u16, message: String },
    #[error("could not reach worker {worker}: {message}")]
    Connect { worker: String, message: String },
    #[error("prefill worker {worker} failed the request: {message}")]
    Prefill { worker: String, status: u16, message: String },
    #[error("the router is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Conflict(String),
    #[error("internal router error: {0}")]
    Internal(String),
}

impl RouterError {
    pub fn status(&self) -> StatusCode {
        use RouterError::*;
        match self {
            Unauthorized => StatusCode::UNAUTHORIZED,
            PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BadJson(_) | BadRequest(_) => StatusCode::BAD_REQUEST,
            NotFound { .. } => StatusCode::NOT_FOUND,
            QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            QueueTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            NoWorker(_) | ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            Upstream { status, .. } | Prefill { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
            }
            Connect { .. } => StatusCode::BAD_GATEWAY,
            Conflict(_) => StatusCode::CONFLICT,
            Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn kind(&self) -> &'static str {
        use RouterError::*;
        match self {
            Unauthorized => "authentication_error",
            PayloadTooLarge { .. } | BadJson(_) | BadRequest(_) | NotFound { .. } | Conflict(_) => {
                "invalid_request_error"
            }
            QueueFull(_) | QueueTimeout(_) => "rate_limit_error",
            Timeout(_) => "timeout_error",
            NoWorker(_) | ShuttingDown => "service_unavailable",
            Upstream { .. } | Connect { .. } | Prefill { .. } => "upstream_error",
            Internal(_) => "internal_error",
        }
    }

    /// Whether another attempt on another worker may succeed (only before the client saw a byte).
    pub fn retryable(&self) -> bool {
        match self {
            RouterError::Connect { .. } => true,
            RouterError::Upstream { status, .. } | RouterError::Prefill { status, .. } => {
                matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
            }
            _ => false,
        }
    }

    /// Whether the failure counts against the worker's circuit breaker.
    pub fn is_worker_fault(&self) -> bool {
        match self {
            RouterError::Connect { .. } => true,
            RouterError::Upstream { status, .. } | RouterError::Prefill { status, .. } => *status >= 500,
            _ => false,
        }
    }

    pub fn body(&self) -> Bytes {
        error_body(&self.to_string(), self.kind(), self.status().as_u16())
    }
}

/// The JSON error document every error response carries.
pub fn error_body(message: &str, kind: &str, code: u16) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": kind, "code": code}});
    Bytes::from(v.to_string())
}

/// Pulls a readable message out of a worker's error body (OpenAI style or plain text).
pub fn upstream_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        if let Some(m) = v.pointer("/error/message").and_then(|m| m.as_str()) {
            return m.to_string();
        }
        if let Some(m) = v.get("error").and_then(|m| m.as_str()) {
            return m.to_string();
        }
    }
    let s = String::from_utf8_lossy(body);
    let s = s.trim();
    if s.is_empty() {
        "empty response".into()
    } else {
        s.chars().take(500).collect()
    }
}
