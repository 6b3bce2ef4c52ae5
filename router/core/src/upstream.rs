//! Connections to workers, each driven by the task that uses it.
//!
//! hyper's pooled client (`hyper_util::client::legacy`) runs every connection in a task of its
//! own and hands response chunks to the caller over a channel. For a stream that costs, per
//! event: a wake-up of the connection task, a hand-off, a wake-up of the task that writes to
//! the client, and one `writev` to the client per event, because by the time that task looks
//! again the next event has not been decoded yet. Measured on the router under a 32-stream load
//! (strace): 110,677 `writev` against 11,830 reads from the worker, and 58% of the router's CPU
//! time in the kernel.
//!
//! Here a request leases an HTTP/1.1 connection from a per-worker pool and polls the
//! connection itself, inside the same task that forwards the response ([`UpBody`]): when the
//! response body has nothing ready, the connection is polled once to read and decode whatever
//! the worker already sent, then the body is looked at again. Events that arrived together are
//! handed to the server side one after another in one pass, and hyper's server writes them in
//! one `writev`; nothing waits for data that has not arrived, so no event is delayed. A
//! response read to its end gives the connection back to the pool; one dropped early (the
//! client went away, an error) closes it, which is how a worker learns that its request was
//! abandoned. Idle connections are not polled: one the worker closed meanwhile is found at
//! checkout (one poll reads its EOF) or dropped by `prune` (run with the policy maintenance,
//! every --eviction-interval-secs) once idle for longer than the idle timeout. A close that
//! lands between checkout and the request's write ends the connection without writing it
//! (uvicorn closes keep-alive connections idle for 5 s, the health probe's period): the
//! finished connection is dropped at once, which hands the request back, and it goes out on a
//! new connection. (Kept instead, the connection held it unsent for ever: a PD request's
//! prefill half then waited until the decode side's 10 s bootstrap deadline failed the room.)

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

pub type ReqBody = Full<Bytes>;
type Conn = http1::Connection<TokioIo<TcpStream>, ReqBody>;

/// Pool settings.
#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_idle_per_worker: usize,
    pub tcp_keepalive: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_idle_per_worker: 1024,
            tcp_keepalive: Duration::from_secs(30),
        }
    }
}

/// An idle keep-alive connection to one worker (`key` is its `host:port`).
struct Idle {
    lease: Lease,
    since: Instant,
}

struct Inner {
    cfg: PoolConfig,
    idle: Mutex<HashMap<Arc<str>, Vec<Idle>>>,
}

/// Keep-alive connections to workers, by `host:port`. Cloning shares the pool.
#[derive(Clone)]
pub struct Pool(Arc<Inner>);

/// One connection while a request uses it.
struct Lease {
    key: Arc<str>,
    tx: http1::SendRequest<ReqBody>,
    /// None once the connection future finished (closed or failed). It is dropped then, not
    /// kept: a request queued on it but never written is handed back (as hyper's `TrySendError`
    /// message) only when the connection is dropped, so a finished connection kept here left
    /// that request waiting for ever (a worker closing an idle connection just after checkout).
    conn: Option<Conn>,
}

impl Lease {
    /// Lets the connection do whatever I/O is possible now (write the request, read and decode
    /// the response); registers this task for more.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(conn) = self.conn.as_mut() {
            if Pin::new(conn).poll(cx).is_ready() {
                self.conn = None;
            }
        }
    }

    fn closed(&self) -> bool {
        self.conn.is_none()
    }

    fn reusable(&self) -> bool {
        !self.closed() && self.tx.is_ready()
    }
}

impl Pool {
    pub fn new(cfg: PoolConfig) -> Self {
        Pool(Arc::new(Inner { cfg, idle: Mutex::new(HashMap::new()) }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Vec<Idle>>> {
        self.0.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Idle connections to `key` (for tests and metrics).
    pub fn idle_count(&self, key: &str) -> usize {
        self.lock().get(key).map_or(0, Vec::len)
    }

    /// Drops connections idle for longer than the idle timeout.
    pub fn prune(&self) {
        let limit = self.0.cfg.idle_timeout;
        self.lock().retain(|_, v| {
            v.retain(|i| i.since.elapsed() < limit);
            !v.is_empty()
        });
    }

    fn put(&self, lease: Lease) {
        let max = self.0.cfg.max_idle_per_worker;
        let mut g = self.lock();
        let v = match g.get_mut(&*lease.key) {
            Some(v) => v,
            None => g.entry(lease.key.clone()).or_default(),
        };
        if v.len() >= max {
            v.remove(0);
        }
        v.push(Idle { lease, since: Instant::now() });
    }

    fn pop(&self, key: &str) -> Option<Idle> {
        self.lock().get_mut(key)?.pop()
    }

    async fn connect(&self, key: &str) -> Result<Lease, UpstreamError> {
        let cfg = &self.0.cfg;
        let stream = match tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(key)).await {
            Err(_) => return Err(UpstreamError::ConnectTimeout(cfg.connect_timeout)),
            Ok(Err(e)) => return Err(UpstreamError::Connect(e)),
            Ok(Ok(s)) => s,
        };
        stream.set_nodelay(true).map_err(UpstreamError::NoDelay)?;
        let ka = socket2::TcpKeepalive::new().with_time(cfg.tcp_keepalive);
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&ka);
        let (tx, conn) = http1::Builder::new().handshake(TokioIo::new(stream)).await.map_err(|e| UpstreamError::Handshake(error_chain(&e)))?;
        Ok(Lease { key: Arc::from(key), tx, conn: Some(conn) })
    }

    /// A live pooled connection to `key` (most recently used first), or a new one. The bool
    /// says whether it was pooled.
    async fn checkout(&self, key: &str) -> Result<(Lease, bool), UpstreamError> {
        while let Some(Idle { mut lease, since }) = self.pop(key) {
            if since.elapsed() >= self.0.cfg.idle_timeout {
                continue;
            }
            // Nobody polled it while it was idle: one poll reads an EOF the worker may have sent.
            let alive = poll_fn(|cx| {
                lease.drive(cx);
                Poll::Ready(lease.reusable())
            })
            .await;
            if alive {
                return Ok((lease, true));
            }
        }
        Ok((self.connect(key).await?, false))
    }

    /// Sends `req` (origin-form URI, `Host` set) to `key` and waits for the response head,
    /// driving the connection meanwhile. A request that a pooled connection never got to
    /// write (the worker had closed it) is sent again on a new connection.
    pub async fn request(&self, key: &str, req: Request<ReqBody>) -> Result<Response<UpBody>, UpstreamError> {
        let mut req = req;
        loop {
            let (lease, pooled) = self.checkout(key).await?;
            match self.send(lease, req).await {
                Ok(resp) => return Ok(resp),
                Err(Unsent::Back(r, _)) if pooled => req = r,
                Err(Unsent::Back(_, why) | Unsent::Failed(why)) => return Err(UpstreamError::Exchange(why)),
            }
        }
    }

    /// Sends `req` on `lease` and waits for the response head, driving the connection meanwhile.
    async fn send(&self, mut lease: Lease, req: Request<ReqBody>) -> Result<Response<UpBody>, Unsent> {
        let fut = lease.tx.try_send_request(req);
        let mut fut = std::pin::pin!(fut);
        let res = poll_fn(|cx| {
            lease.drive(cx);
            fut.as_mut().poll(cx)
        })
        .await;
        match res {
            Ok(resp) => Ok(resp.map(|inner| UpBody { inner, lease: Some(lease), pool: self.clone() })),
            Err(mut e) => Err(match e.take_message() {
                Some(r) => Unsent::Back(r, error_chain(e.error())),
                None => Unsent::Failed(error_chain(e.error())),
            }),
        }
    }
}

/// Why `send` got no response head: the connection closed before writing the request (which
/// comes back, to be sent on another), or the exchange failed after it.
enum Unsent {
    Back(Request<ReqBody>, String),
    Failed(String),
}

/// Why a request got no response head from a worker.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("connect timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("TCP_NODELAY: {0}")]
    NoDelay(std::io::Error),
    #[error("handshake: {0}")]
    Handshake(String),
    /// The request could not be written or its response read (hyper's error and its causes).
    #[error("{0}")]
    Exchange(String),
}

fn error_chain(e: &hyper::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// A worker's response body. Polling it also drives its connection (see the module docs);
/// at its end the connection goes back to the pool, dropped early it is closed.
pub struct UpBody {
    inner: Incoming,
    lease: Option<Lease>,
    pool: Pool,
}

impl std::fmt::Debug for UpBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpBody").field("pooled_connection", &self.lease.is_some()).finish()
    }
}

impl UpBody {
    fn finish(&mut self, cx: &mut Context<'_>) {
        if let Some(mut lease) = self.lease.take() {
            // One more poll lets the connection settle into its idle state.
            lease.drive(cx);
            if lease.reusable() {
                self.pool.put(lease);
            }
        }
    }
}

impl Drop for UpBody {
    fn drop(&mut self) {
        // A body that was complete without being polled to its end (an empty one, say) still
        // gives its connection back; any other is cut short, and its connection closes.
        if self.lease.is_some() && self.inner.is_end_stream() {
            self.finish(&mut Context::from_waker(std::task::Waker::noop()));
        }
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        for pass in 0..2 {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => {
                    // hyper's server stops polling a body whose length is known once it has
                    // it all, so the end is noticed here rather than by a final `None`.
                    if this.inner.is_end_stream() {
                        this.finish(cx);
                    }
                    return Poll::Ready(Some(Ok(f)));
                }
                Poll::Ready(None) => {
                    this.finish(cx);
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    this.lease = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Pending => {}
            }
            match this.lease.as_mut() {
                Some(l) if pass == 0 && !l.closed() => l.drive(cx),
                _ => break,
            }
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use hyper::service::service_fn;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A worker stand-in: answers every request with `chunks` chunks, with a Content-Length
    /// if `sized` (else chunked); counts accepted connections.
    async fn server(chunks: usize, sized: bool) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let acc = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                acc.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = service_fn(move |_req: Request<Incoming>| async move {
                        let frames = (0..chunks).map(|i| Bytes::from(format!("data: {i}\n\n"))).collect();
                        Ok::<_, std::convert::Infallible>(Response::new(Chunks(frames, sized)))
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
                });
            }
        });
        (addr, accepted)
    }

    /// A body of ready chunks; with its exact length announced if `.1`.
    struct Chunks(std::collections::VecDeque<Bytes>, bool);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
        fn size_hint(&self) -> SizeHint {
            match self.1 {
                true => SizeHint::with_exact(self.0.iter().map(|b| b.len() as u64).sum()),
                false => SizeHint::default(),
            }
        }
    }

    fn get(key: &str) -> Request<ReqBody> {
        Request::builder().uri("/x").header("host", key).body(Full::new(Bytes::new())).unwrap()
    }

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection() {
        let (addr, accepted) = server(5, false).await;
        let pool = Pool::new(PoolConfig::default());
        for _ in 0..50 {
            let resp = pool.request(&addr, get(&addr)).await.unwrap();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(&addr), 1);
    }

    #[tokio::test]
    async fn a_body_read_to_its_known_length_gives_the_connection_back() {
        let (addr, accepted) = server(1, true).await;
        let pool = Pool::new(PoolConfig::default());
        for _ in 0..20 {
            // Read like hyper's server does: frames until `is_end_stream`, then drop the body.
            let mut body = pool.request(&addr, get(&addr)).await.unwrap().into_body();
            while !body.is_end_stream() {
                body.frame().await.unwrap().unwrap();
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_empty_body_dropped_unread_gives_the_connection_back() {
        let (addr, accepted) = server(0, true).await;
        let pool = Pool::new(PoolConfig::default());
        for _ in 0..5 {
            let body = pool.request(&addr, get(&addr)).await.unwrap().into_body();
            assert!(body.is_end_stream());
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_body_dropped_early_closes_its_connection() {
        let (addr, accepted) = server(1000, false).await;
        let pool = Pool::new(PoolConfig::default());
        let resp = pool.request(&addr, get(&addr)).await.unwrap();
        let mut body = resp.into_body();
        body.frame().await.unwrap().unwrap();
        drop(body);
        assert_eq!(pool.idle_count(&addr), 0);
        let resp = pool.request(&addr, get(&addr)).await.unwrap();
        resp.into_body().collect().await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Answers "ok" on one connection for 50 ms, then closes it without saying so in a header.
    async fn serve_ok_then_close(s: tokio::net::TcpStream) {
        let svc = service_fn(|_req: Request<Incoming>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), svc);
        tokio::pin!(conn);
        let _ = tokio::time::timeout(Duration::from_millis(50), conn.as_mut()).await;
    }

    #[tokio::test]
    async fn a_pooled_connection_the_worker_closed_is_replaced() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                tokio::spawn(serve_ok_then_close(s));
            }
        });
        let pool = Pool::new(PoolConfig::default());
        for _ in 0..3 {
            let resp = pool.request(&addr, get(&addr)).await.unwrap();
            assert_eq!(&resp.into_body().collect().await.unwrap().to_bytes()[..], b"ok");
            tokio::time::sleep(Duration::from_millis(120)).await;
        }
    }

    #[tokio::test]
    async fn a_request_on_a_connection_closed_before_it_was_written_comes_back() {
        // The race behind a PD request that waited 10 s for nothing: a worker closes an idle
        // keep-alive connection (uvicorn does after 5 s) after checkout found it alive and before
        // the request is written. The connection then ends cleanly without writing it; the
        // request must come back to be sent on another connection, not wait on this one.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            serve_ok_then_close(s).await;
        });
        let pool = Pool::new(PoolConfig::default());
        let resp = pool.request(&addr, get(&addr)).await.unwrap();
        assert_eq!(&resp.into_body().collect().await.unwrap().to_bytes()[..], b"ok");
        tokio::time::sleep(Duration::from_millis(150)).await; // the close has arrived, unread
        let Idle { lease, .. } = pool.pop(&addr).expect("the connection went back to the pool");
        let sent = tokio::time::timeout(Duration::from_secs(5), pool.send(lease, get(&addr)))
            .await
            .expect("the request waited on a connection that had ended");
        match sent {
            Err(Unsent::Back(req, _)) => assert_eq!(req.uri(), "/x"),
            Err(Unsent::Failed(why)) => panic!("the request was not handed back: {why}"),
            Ok(_) => panic!("a closed connection answered"),
        }
    }

    #[tokio::test]
    async fn connect_errors_are_reported() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let key = format!("127.0.0.1:{port}");
        let err = Pool::new(PoolConfig::default()).request(&key, get(&key)).await.unwrap_err();
        assert!(matches!(err, UpstreamError::Connect(_)), "{err}");
        assert!(err.to_string().starts_with("connect: "), "{err}");
    }
}
