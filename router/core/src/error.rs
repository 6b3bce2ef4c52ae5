//! Typed errors and their OpenAI-style JSON rendering `{"error": {"message", "type", "param", "code"}}`.
//!
//! A worker's own error answer travels to the client unchanged (status and body: type, param and code intact),
//! as a [`Reply`]; the router's own errors use the same shape. Messages to clients never name a worker's
//! address: that goes to the log, with the request id.

use bytes::Bytes;
use http::StatusCode;

/// A worker's OpenAI-shaped error body, kept to be passed through; `request_fault` when the worker said the
/// request itself caused the failure (`code: "request_failed"`), so no other worker would do better.
#[derive(Debug, Clone)]
pub struct Reply {
    pub body: Bytes,
    pub request_fault: bool,
}

impl Reply {
    /// The reply when `body` is an OpenAI-style error document, else None.
    pub fn parse(body: &[u8]) -> Option<Reply> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let err = v.get("error")?.as_object()?;
        err.get("message")?.as_str()?;
        let request_fault = err.get("code").and_then(|c| c.as_str()) == Some("request_failed");
        Some(Reply { body: Bytes::copy_from_slice(body), request_fault })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("missing or invalid API key; send `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("request body is larger than --max-payload-size ({limit} bytes)")]
    PayloadTooLarge { limit: usize },
    #[error("request headers are larger than --max-header-size ({limit} bytes)")]
    HeaderTooLarge { limit: usize },
    #[error("request body is not valid JSON: {0}")]
    BadJson(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("{path} does not take {method}; it takes {allow}")]
    MethodNotAllowed { method: String, path: String, allow: &'static str },
    #[error("too many requests: the router's queue is full (--queue-size {0})")]
    QueueFull(usize),
    #[error("request waited longer than --queue-timeout-secs ({0}s) for a slot")]
    QueueTimeout(f64),
    #[error("request did not finish within --request-timeout-secs ({0}s)")]
    Timeout(f64),
    #[error("the worker sent nothing for --stall-timeout-secs ({0}s); the request is ended and the worker taken out of rotation until a health check passes")]
    Stalled(f64),
    #[error("no healthy {0} worker is available")]
    NoWorker(&'static str),
    #[error("worker {worker} failed: {message}")]
    Upstream { worker: String, status: u16, message: String, reply: Option<Reply> },
    #[error("could not reach worker {worker}: {message}")]
    Connect { worker: String, message: String },
    #[error("prefill worker {worker} failed the request: {message}")]
    Prefill { worker: String, status: u16, message: String, reply: Option<Reply> },
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
            HeaderTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            BadJson(_) | BadRequest(_) => StatusCode::BAD_REQUEST,
            NotFound { .. } => StatusCode::NOT_FOUND,
            MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            QueueTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Timeout(_) | Stalled(_) => StatusCode::GATEWAY_TIMEOUT,
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
            PayloadTooLarge { .. } | HeaderTooLarge { .. } | BadJson(_) | BadRequest(_) | NotFound { .. } | MethodNotAllowed { .. } | Conflict(_) => {
                "invalid_request_error"
            }
            QueueFull(_) | QueueTimeout(_) => "rate_limit_error",
            Timeout(_) | Stalled(_) => "timeout_error",
            NoWorker(_) | ShuttingDown => "service_unavailable",
            Upstream { .. } | Connect { .. } | Prefill { .. } => "upstream_error",
            Internal(_) => "internal_error",
        }
    }

    /// Whether the worker said the request itself caused its failure.
    pub fn request_fault(&self) -> bool {
        match self {
            RouterError::Upstream { reply: Some(r), .. } | RouterError::Prefill { reply: Some(r), .. } => r.request_fault,
            _ => false,
        }
    }

    /// Whether another attempt on another worker may succeed (only before the client saw a byte).
    pub fn retryable(&self) -> bool {
        if self.request_fault() {
            return false;
        }
        match self {
            // Stalled here means no response head yet (a stream's stall, after bytes went out, is never retried).
            RouterError::Connect { .. } | RouterError::Stalled(_) => true,
            RouterError::Upstream { status, .. } | RouterError::Prefill { status, .. } => {
                matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
            }
            _ => false,
        }
    }

    /// Whether the failure counts against the worker's circuit breaker.
    pub fn is_worker_fault(&self) -> bool {
        if self.request_fault() {
            return false;
        }
        match self {
            RouterError::Connect { .. } | RouterError::Stalled(_) => true,
            RouterError::Upstream { status, .. } | RouterError::Prefill { status, .. } => *status >= 500,
            _ => false,
        }
    }

    /// What the client is told: a worker's own error passes through unchanged; the router's errors are
    /// rendered in the same shape, without worker addresses.
    pub fn body(&self) -> Bytes {
        use RouterError::*;
        let message = match self {
            Upstream { reply: Some(r), .. } | Prefill { reply: Some(r), .. } => return r.body.clone(),
            Upstream { message, .. } => format!("a worker failed the request: {message}"),
            Connect { .. } => "could not reach a worker (the attempt is logged with the request id)".into(),
            Prefill { message, .. } => format!("the prefill worker failed the request: {message}"),
            other => other.to_string(),
        };
        error_body(&message, self.kind(), self.code())
    }

    /// The error's `code`: a string, as the workers' (and OpenAI's) are.
    pub fn code(&self) -> &'static str {
        use RouterError::*;
        match self {
            Unauthorized => "invalid_api_key",
            PayloadTooLarge { .. } => "body_too_large",
            HeaderTooLarge { .. } => "header_too_large",
            BadJson(_) => "invalid_json",
            BadRequest(_) => "invalid_request",
            NotFound { .. } => "not_found",
            MethodNotAllowed { .. } => "method_not_allowed",
            QueueFull(_) => "queue_full",
            QueueTimeout(_) => "queue_timeout",
            Timeout(_) => "timeout",
            Stalled(_) => "stalled",
            NoWorker(_) => "no_worker",
            Upstream { .. } | Connect { .. } | Prefill { .. } => "upstream_error",
            ShuttingDown => "shutting_down",
            Conflict(_) => "conflict",
            Internal(_) => "internal_error",
        }
    }

    /// A body serde_json refused. Text that is not Unicode (a lone surrogate escape, bytes that are not
    /// UTF-8) reads as a bare syntax error there, so the message says what is wrong and how to fix it.
    pub fn bad_json(e: &serde_json::Error) -> Self {
        let msg = e.to_string();
        let unicode = ["surrogate", "hex escape", "unicode code point", "utf-8", "UTF-8"].iter().any(|k| msg.contains(k));
        RouterError::BadJson(if unicode {
            format!("{msg}: the body holds text that is not valid Unicode (a lone UTF-16 surrogate such as \\ud800, or bytes that are not UTF-8); send well-formed UTF-8 text")
        } else {
            msg
        })
    }
}

/// The JSON error document every error response carries.
pub fn error_body(message: &str, kind: &str, code: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
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

#[cfg(test)]
mod tests {
    use super::*;

    fn worker_error(status: u16, body: &str) -> RouterError {
        let b = body.as_bytes();
        RouterError::Upstream { worker: "http://10.0.0.7:30200".into(), status, message: upstream_message(b), reply: Reply::parse(b) }
    }

    #[test]
    fn a_workers_error_body_passes_through_unchanged() {
        let body = r#"{"error":{"message":"max_tokens is too large","type":"invalid_request_error","param":"max_tokens","code":"context_length_exceeded"}}"#;
        let e = worker_error(400, body);
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.body(), Bytes::from(body));
        assert!(!e.retryable() && !e.is_worker_fault());
    }

    #[test]
    fn a_request_caused_500_is_neither_retried_nor_blamed_on_the_worker() {
        let e = worker_error(500, r#"{"error":{"message":"this request failed in sampling","type":"server_error","param":null,"code":"request_failed"}}"#);
        assert!(e.request_fault() && !e.retryable() && !e.is_worker_fault());
        let crash = worker_error(500, r#"{"error":{"message":"internal error","type":"server_error","code":"internal_error"}}"#);
        assert!(!crash.request_fault() && crash.retryable() && crash.is_worker_fault());
    }

    #[test]
    fn router_made_errors_name_no_worker_address_and_keep_the_shape() {
        let plain = worker_error(502, "Bad Gateway");
        let connect = RouterError::Connect { worker: "http://10.0.0.7:30200".into(), message: "tcp connect error 10.0.0.7:30200".into() };
        for e in [plain, connect] {
            let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
            let text = v.to_string();
            assert!(!text.contains("10.0.0.7"), "{text}");
            assert!(v.pointer("/error/param").is_some() && v.pointer("/error/type").is_some(), "{text}");
        }
    }
}
