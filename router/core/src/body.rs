//! The response body the router streams to its client: a worker's body passed through frame by
//! frame (no buffering), holding the load guards and the concurrency permit until it ends or
//! the client goes away. In PD mode it also watches the prefill side: if prefill fails after
//! the client got its first byte, the decode stream is dropped (which aborts it at the decode
//! worker) and the client gets an error event (SSE) or a cut connection.

use crate::error::RouterError;
use crate::worker::LoadGuard;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use crate::upstream::UpBody;
use hyper::body::{Body, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;
use tokio::time::Sleep;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type RespBody = BoxBody<Bytes, BoxError>;

pub fn full(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

/// The prefill side of a PD attempt, running as a task of its own. Dropping it aborts the task,
/// which closes the prefill connection (the prefill worker aborts the request and its room):
/// whatever ends an attempt early — a decode failure, a deadline, the client going away before
/// or after its first byte — cancels the prefill side with it. `detach` lets it finish instead.
pub struct PrefillTask(Option<JoinHandle<Result<(), RouterError>>>);

impl PrefillTask {
    pub fn spawn(f: impl Future<Output = Result<(), RouterError>> + Send + 'static) -> Self {
        PrefillTask(Some(tokio::spawn(f)))
    }

    /// Lets the task run to completion on its own.
    pub fn detach(mut self) {
        self.0 = None;
    }
}

impl Future for PrefillTask {
    type Output = Result<Result<(), RouterError>, tokio::task::JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.0.as_mut() {
            Some(h) => Pin::new(h).poll(cx),
            None => Poll::Pending,
        }
    }
}

impl Drop for PrefillTask {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

pub struct ProxyBody {
    pub first: Option<Bytes>,
    pub inner: Option<UpBody>,
    pub prefill: Option<PrefillTask>,
    pub guards: Vec<LoadGuard>,
    pub permit: Option<OwnedSemaphorePermit>,
    pub deadline: Pin<Box<Sleep>>,
    pub timeout_secs: f64,
    /// SSE only: re-armed by every frame; firing ends the stream and takes the worker out of rotation.
    pub stall: Option<Pin<Box<Sleep>>>,
    pub stall_secs: f64,
    pub sse: bool,
    pub request_id: String,
}

impl ProxyBody {
    fn fail(&mut self, err: RouterError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        tracing::warn!(request_id = %self.request_id, error = %err, "response stream aborted");
        self.inner = None;
        self.prefill = None;
        if self.sse {
            let ev = format!("data: {}\n\n", String::from_utf8_lossy(&err.body()));
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(ev)))))
        } else {
            Poll::Ready(Some(Err(Box::new(err))))
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(b) = this.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        if this.inner.is_none() {
            return Poll::Ready(None);
        }
        if let Some(p) = this.prefill.as_mut() {
            if let Poll::Ready(r) = Pin::new(p).poll(cx) {
                this.prefill = None;
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return this.fail(e),
                    Err(e) => return this.fail(RouterError::Internal(format!("prefill task: {e}"))),
                }
            }
        }
        let inner = this.inner.as_mut().expect("checked above");
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(s) = this.stall.as_mut() {
                    s.as_mut().reset(tokio::time::Instant::now() + std::time::Duration::from_secs_f64(this.stall_secs));
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => {
                let worker = this.guards.last().map(|g| g.worker().url.to_string()).unwrap_or_default();
                if let Some(g) = this.guards.last() {
                    g.worker().breaker.record(false);
                }
                this.fail(RouterError::Upstream { worker, status: 502, message: format!("stream broke: {e}"), reply: None })
            }
            Poll::Ready(None) => {
                this.inner = None;
                // Prefill still finishing (it normally ends first): let it run to completion.
                if let Some(p) = this.prefill.take() {
                    p.detach();
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                // Only while waiting on the worker can the deadline matter (and its timer is
                // registered once per wait, not once per frame).
                if this.deadline.as_mut().poll(cx).is_ready() {
                    let secs = this.timeout_secs;
                    return this.fail(RouterError::Timeout(secs));
                }
                if this.stall.as_mut().is_some_and(|s| s.as_mut().poll(cx).is_ready()) {
                    if let Some(g) = this.guards.last() {
                        let w = g.worker();
                        w.breaker.record(false);
                        if w.mark_unhealthy() {
                            tracing::warn!(worker = %w.url, request_id = %this.request_id, stall_secs = this.stall_secs,
                                "a stream stalled; worker out of rotation until a health check passes");
                        }
                    }
                    let secs = this.stall_secs;
                    return this.fail(RouterError::Stalled(secs));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.inner, &self.first) {
            (Some(b), None) => b.size_hint(),
            (Some(b), Some(f)) => {
                let h = b.size_hint();
                let mut s = SizeHint::new();
                s.set_lower(h.lower() + f.len() as u64);
                if let Some(u) = h.upper() {
                    s.set_upper(u + f.len() as u64);
                }
                s
            }
            (None, Some(f)) => SizeHint::with_exact(f.len() as u64),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}
