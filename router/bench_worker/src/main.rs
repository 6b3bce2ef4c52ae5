//! Stand-in worker for router benchmarks (not a model server): answers `/generate`,
//! `/v1/completions`, `/v1/chat/completions` (streamed or not) with canned tokens, plus
//! `/health`, `/get_load`, `/v1/models`, `/flush_cache`, and `/bench_stats`. It simulates a
//! prefix cache: each prompt is matched against the prompts it has seen (an LRU-bounded radix
//! tree), the matched bytes count as cached, and an optional delay per uncached byte models
//! prefill work. Usage: splitserve-bench-worker PORT [--chunks N] [--chunk-delay-us N]
//! [--ns-per-uncached-byte N] [--base-us N] [--cache-bytes N] [--threads N]
//! A prompt starting with `[gap_us=N]` overrides --chunk-delay-us for its stream.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prefix_tree::PrefixTree;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

#[derive(Clone, Copy)]
struct Opts {
    chunks: usize,
    chunk_delay_us: u64,
    ns_per_byte: u64,
    base_us: u64,
    cache_bytes: usize,
}

#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    prompt_bytes: AtomicU64,
    cached_bytes: AtomicU64,
    running: AtomicUsize,
}

struct Worker {
    opts: Opts,
    cache: PrefixTree,
    stats: Stats,
}

/// SSE body: `chunks` events, each written separately, then `[DONE]`.
struct Sse {
    left: usize,
    delay: Option<Pin<Box<tokio::time::Sleep>>>,
    gap: Duration,
    yielded: bool,
    done: bool,
}

impl Body for Sse {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(d) = self.delay.as_mut() {
            if d.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.delay = None;
        } else if !self.yielded {
            // Let hyper flush the previous event on its own before the next one.
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.yielded = false;
        if self.left == 0 {
            self.done = true;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))));
        }
        self.left -= 1;
        if !self.gap.is_zero() {
            let g = self.gap;
            self.delay = Some(Box::pin(tokio::time::sleep(g)));
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: {\"text\": \"tok\", \"choices\": [{\"text\": \"tok\", \"index\": 0}]}\n\n")))))
    }
}

use std::future::Future;

type Out = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

fn json(status: StatusCode, s: String) -> Response<Out> {
    let mut r = Response::new(Full::new(Bytes::from(s)).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", "application/json".parse().unwrap());
    r
}

fn prompt_text(v: &serde_json::Value) -> Vec<u8> {
    for k in ["text", "prompt"] {
        if let Some(s) = v.get(k).and_then(|s| s.as_str()) {
            return s.as_bytes().to_vec();
        }
    }
    if let Some(msgs) = v.get("messages").and_then(|m| m.as_array()) {
        let mut out = Vec::new();
        for m in msgs {
            if let Some(c) = m.get("content").and_then(|c| c.as_str()) {
                out.extend_from_slice(c.as_bytes());
            }
        }
        return out;
    }
    Vec::new()
}

async fn handle(w: Arc<Worker>, req: Request<Incoming>) -> Result<Response<Out>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let body = req.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let s = &w.stats;
    Ok(match path.as_str() {
        "/health" | "/health_generate" => json(StatusCode::OK, "{}".into()),
        "/get_load" => json(StatusCode::OK, format!("{{\"running\": {}, \"queued\": 0, \"kv_pages_used\": 0, \"kv_pages_total\": 1000}}", s.running.load(Ordering::Relaxed))),
        "/get_model_info" => json(StatusCode::OK, "{\"model_path\": \"bench\", \"is_generation\": true}".into()),
        "/get_server_info" => json(StatusCode::OK, "{\"role\": \"bench\"}".into()),
        "/v1/models" => json(StatusCode::OK, "{\"object\": \"list\", \"data\": [{\"id\": \"bench\", \"object\": \"model\"}]}".into()),
        "/flush_cache" => {
            w.cache.clear();
            json(StatusCode::OK, "{}".into())
        }
        "/bench_stats" => json(StatusCode::OK, format!(
            "{{\"requests\": {}, \"prompt_bytes\": {}, \"cached_bytes\": {}}}",
            s.requests.load(Ordering::Relaxed), s.prompt_bytes.load(Ordering::Relaxed), s.cached_bytes.load(Ordering::Relaxed))),
        "/generate" | "/v1/completions" | "/v1/chat/completions" => {
            let v: serde_json::Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => return Ok(json(StatusCode::BAD_REQUEST, format!("{{\"error\": {{\"message\": \"bad json: {e}\", \"type\": \"invalid_request_error\", \"code\": 400}}}}"))),
            };
            let text = prompt_text(&v);
            let cached = if text.is_empty() { 0 } else { w.cache.match_tenants(&text).len_for("self") };
            if !text.is_empty() {
                w.cache.insert(&text, "self");
            }
            let n = s.requests.fetch_add(1, Ordering::Relaxed);
            s.prompt_bytes.fetch_add(text.len() as u64, Ordering::Relaxed);
            s.cached_bytes.fetch_add(cached as u64, Ordering::Relaxed);
            if n % 256 == 0 {
                w.cache.evict(w.opts.cache_bytes);
            }
            let work = w.opts.base_us * 1000 + w.opts.ns_per_byte * (text.len() - cached) as u64;
            s.running.fetch_add(1, Ordering::Relaxed);
            if work > 0 {
                tokio::time::sleep(Duration::from_nanos(work)).await;
            }
            s.running.fetch_sub(1, Ordering::Relaxed);
            if v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false) {
                // A prompt starting with "[gap_us=N]" overrides --chunk-delay-us (the prompt is the
                // one field every router forwards unchanged).
                let gap_us = std::str::from_utf8(&text)
                    .ok()
                    .and_then(|t| t.strip_prefix("[gap_us="))
                    .and_then(|t| t.split(']').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(w.opts.chunk_delay_us);
                let body = Sse { left: w.opts.chunks, delay: None, gap: Duration::from_micros(gap_us), yielded: true, done: false };
                let mut r = Response::new(body.boxed());
                r.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
                r
            } else {
                json(StatusCode::OK, format!("{{\"text\": \"tok tok\", \"choices\": [{{\"index\": 0, \"text\": \"tok tok\"}}], \"meta_info\": {{\"prompt_tokens\": {}, \"cached_tokens\": {cached}}}}}", text.len()))
            }
        }
        _ => json(StatusCode::NOT_FOUND, "{\"error\": {\"message\": \"not found\", \"type\": \"invalid_request_error\", \"code\": 404}}".into()),
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = args.get(1).and_then(|p| p.parse().ok()).expect("usage: splitserve-bench-worker PORT [--chunks N] ...");
    let get = |flag: &str, d: u64| -> u64 {
        args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(d)
    };
    let opts = Opts {
        chunks: get("--chunks", 16) as usize,
        chunk_delay_us: get("--chunk-delay-us", 0),
        ns_per_byte: get("--ns-per-uncached-byte", 0),
        base_us: get("--base-us", 0),
        cache_bytes: get("--cache-bytes", 1 << 30) as usize,
    };
    let threads = get("--threads", 1) as usize;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build().expect("runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
        let w = Arc::new(Worker { opts, cache: PrefixTree::new(), stats: Stats::default() });
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let _ = stream.set_nodelay(true);
            let w = w.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(w.clone(), req));
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
}
