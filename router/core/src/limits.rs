//! Concurrency limit with a bounded queue: at most --max-concurrent-requests requests are
//! forwarded at once; up to --queue-size more wait (429 when the queue is full), each at most
//! --queue-timeout-secs (408 after that). A permit is held until the response body ends.

use crate::error::RouterError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Limiter {
    sem: Arc<Semaphore>,
    queued: AtomicUsize,
    queue_size: usize,
    timeout: Duration,
}

impl Limiter {
    pub fn new(max_concurrent: usize, queue_size: usize, timeout: Duration) -> Self {
        Limiter { sem: Arc::new(Semaphore::new(max_concurrent)), queued: AtomicUsize::new(0), queue_size, timeout }
    }

    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    pub async fn acquire(&self) -> Result<OwnedSemaphorePermit, RouterError> {
        if let Ok(p) = self.sem.clone().try_acquire_owned() {
            return Ok(p);
        }
        let prev = self.queued.fetch_add(1, Ordering::AcqRel);
        if prev >= self.queue_size {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(RouterError::QueueFull(self.queue_size));
        }
        let r = tokio::time::timeout(self.timeout, self.sem.clone().acquire_owned()).await;
        self.queued.fetch_sub(1, Ordering::AcqRel);
        match r {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(_)) => Err(RouterError::ShuttingDown),
            Err(_) => Err(RouterError::QueueTimeout(self.timeout.as_secs_f64())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn full_queue_is_refused_and_long_waits_time_out() {
        let l = Arc::new(Limiter::new(1, 1, Duration::from_millis(50)));
        let held = l.acquire().await.unwrap();
        let waiter = {
            let l = l.clone();
            tokio::spawn(async move { l.acquire().await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.queued(), 1);
        assert!(matches!(l.acquire().await, Err(RouterError::QueueFull(1))));
        assert!(matches!(waiter.await.unwrap(), Err(RouterError::QueueTimeout(_))));
        drop(held);
        assert!(l.acquire().await.is_ok());
    }
}
