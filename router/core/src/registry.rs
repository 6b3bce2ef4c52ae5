//! The set of workers, by role. Reads (every request) clone an `Arc` snapshot; changes (add,
//! remove, discovery) swap in a new one. A removed worker is kept in `draining` until its
//! in-flight requests have finished: they are never cut, only new ones stop going there.

use crate::breaker::BreakerConfig;
use crate::error::RouterError;
use crate::worker::{Role, Worker};
use std::sync::{Arc, Mutex, RwLock};

pub struct Registry {
    workers: RwLock<Arc<Vec<Arc<Worker>>>>,
    draining: Mutex<Vec<Arc<Worker>>>,
    pub breaker: BreakerConfig,
}

impl Registry {
    pub fn new(breaker: BreakerConfig) -> Self {
        Registry { workers: RwLock::new(Arc::new(Vec::new())), draining: Mutex::new(Vec::new()), breaker }
    }

    pub fn all(&self) -> Arc<Vec<Arc<Worker>>> {
        self.workers.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Workers of `role` that can take a request now.
    pub fn available(&self, role: Role) -> Vec<Arc<Worker>> {
        self.all().iter().filter(|w| w.role == role && w.is_available()).cloned().collect()
    }

    pub fn get(&self, url: &str) -> Option<Arc<Worker>> {
        let url = url.trim_end_matches('/');
        self.all().iter().find(|w| &*w.url == url).cloned()
    }

    /// Adds a worker; `healthy` is its state until the first health checks say otherwise.
    pub fn add(&self, url: &str, role: Role, bootstrap_port: Option<u16>, healthy: bool) -> Result<Arc<Worker>, RouterError> {
        let w = Worker::new(url, role, bootstrap_port, self.breaker, healthy);
        let mut g = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if g.iter().any(|x| x.url == w.url) {
            return Err(RouterError::Conflict(format!("worker {} is already registered", w.url)));
        }
        let mut next = (**g).clone();
        next.push(w.clone());
        *g = Arc::new(next);
        tracing::info!(worker = %w.url, role = role.as_str(), "worker added");
        Ok(w)
    }

    /// Removes a worker from routing; it drains whatever it still has in flight.
    pub fn remove(&self, url: &str) -> Option<Arc<Worker>> {
        let url = url.trim_end_matches('/');
        let mut g = self.workers.write().unwrap_or_else(|e| e.into_inner());
        let pos = g.iter().position(|w| &*w.url == url)?;
        let mut next = (**g).clone();
        let w = next.remove(pos);
        *g = Arc::new(next);
        drop(g);
        tracing::info!(worker = %w.url, in_flight = w.load(), "worker removed; draining");
        self.draining.lock().unwrap_or_else(|e| e.into_inner()).push(w.clone());
        Some(w)
    }

    /// Removed workers that still have requests in flight (finished ones are forgotten).
    pub fn draining(&self) -> Vec<Arc<Worker>> {
        let mut d = self.draining.lock().unwrap_or_else(|e| e.into_inner());
        d.retain(|w| w.load() > 0);
        d.clone()
    }
}
