//! cache_aware — for each routable worker w let
//!   m_w = (bytes of the request text matched in w's part of the approximate prefix tree) / (text bytes)
//!   L_w = requests in flight from this router to w (counted from dispatch until the response
//!         ends, by a guard, so streams and errors are included), L_min = min_w L_w
//!   overloaded(w) := L_w - L_min > balance_abs_threshold  AND  L_w > balance_rel_threshold * L_min
//!   A = { w : m_w >= cache_threshold AND NOT overloaded(w) },  m_A = max_{w in A} m_w
//!   B = { w in A : m_w >= m_A - NEAR }   (NEAR = 0.05: matches a few bytes apart are equal)
//! choose argmin_{w in B} L_w if A is not empty (affinity: the longest match, and among
//! workers holding about as much of the text the lightest, so a prefix held by several
//! workers spreads over them instead of following whichever saw a slightly longer suffix); otherwise
//! argmin_w L_w with ties broken by a rotating start (so texts nobody holds, arriving one by one
//! at equal loads, go round the workers instead of piling onto one). The chosen worker then
//! holds the text in the tree.
//!
//! Balance is decided per request from the matched worker's own load: an overloaded worker
//! loses only the requests that would have gone to it, and only while it is overloaded, so the
//! rest of the traffic keeps its affinity. The tree is bounded: every --eviction-interval-secs
//! each worker's part is trimmed to --max-tree-size bytes, least recently used bytes first.

use super::{argmin_rotating, Choice, Policy, RouteRequest};
use crate::config::RouterConfig;
use crate::worker::Worker;
use prefix_tree::PrefixTree;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Matched shares closer than this to the best one count as equally good.
const NEAR: f64 = 0.05;

#[derive(Debug, Clone, Copy)]
pub struct CacheAwareConfig {
    pub cache_threshold: f64,
    pub balance_abs_threshold: usize,
    pub balance_rel_threshold: f64,
    pub max_tree_size: usize,
}

impl From<&RouterConfig> for CacheAwareConfig {
    fn from(c: &RouterConfig) -> Self {
        CacheAwareConfig {
            cache_threshold: c.cache_threshold,
            balance_abs_threshold: c.balance_abs_threshold,
            balance_rel_threshold: c.balance_rel_threshold,
            max_tree_size: c.max_tree_size,
        }
    }
}

pub struct CacheAware {
    cfg: CacheAwareConfig,
    tree: PrefixTree,
    rotation: AtomicUsize,
}

impl CacheAware {
    pub fn new(cfg: CacheAwareConfig) -> Self {
        CacheAware { cfg, tree: PrefixTree::new(), rotation: AtomicUsize::new(0) }
    }

    pub fn tree(&self) -> &PrefixTree {
        &self.tree
    }

    fn overloaded(&self, load: usize, min_load: usize) -> bool {
        load - min_load > self.cfg.balance_abs_threshold
            && load as f64 > self.cfg.balance_rel_threshold * min_load as f64
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn needs_text(&self) -> bool {
        true
    }

    fn select(&self, workers: &[Arc<Worker>], req: &RouteRequest<'_>) -> Option<Choice> {
        if workers.is_empty() {
            return None;
        }
        let text = req.text.unwrap_or_default();
        let loads: Vec<usize> = workers.iter().map(|w| w.load()).collect();
        let min_load = loads.iter().copied().min().unwrap_or(0);
        let ratios: Vec<f64> = if text.is_empty() {
            vec![0.0; workers.len()]
        } else {
            let m = self.tree.match_tenants(text);
            workers.iter().map(|w| m.len_for(&w.url) as f64 / text.len() as f64).collect()
        };
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        let affine = |i: usize| ratios[i] >= self.cfg.cache_threshold && ratios[i] > 0.0 && !self.overloaded(loads[i], min_load);
        let best = (0..workers.len()).filter(|&i| affine(i)).map(|i| ratios[i]).fold(f64::NAN, f64::max);
        let index = if !best.is_nan() {
            let near = |i: usize| affine(i) && ratios[i] >= best - NEAR;
            argmin_rotating(workers.len(), start, |i| if near(i) { (loads[i], -ratios[i]) } else { (usize::MAX, 0.0) })?
        } else {
            argmin_rotating(workers.len(), start, |i| loads[i])?
        };
        if !text.is_empty() {
            self.tree.insert(text, &workers[index].url);
        }
        Some(Choice { index, match_ratio: Some(ratios[index]) })
    }

    fn on_worker_removed(&self, url: &str) {
        self.tree.remove_tenant(url);
    }

    fn reset(&self) {
        self.tree.clear();
    }

    fn maintenance(&self) {
        let n = self.tree.evict(self.cfg.max_tree_size);
        if n > 0 {
            tracing::debug!(evicted_bytes = n, "cache_aware tree eviction");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_util::workers;
    use crate::worker::LoadGuard;

    fn policy() -> CacheAware {
        CacheAware::new(CacheAwareConfig {
            cache_threshold: 0.5,
            balance_abs_threshold: 4,
            balance_rel_threshold: 1.5,
            max_tree_size: 1 << 20,
        })
    }

    fn pick(p: &CacheAware, ws: &[Arc<Worker>], text: &str) -> Choice {
        p.select(ws, &RouteRequest { text: Some(text.as_bytes()) }).unwrap()
    }

    #[test]
    fn unmatched_texts_arriving_one_by_one_spread_over_all_workers() {
        let (ws, _g) = workers(&[0, 0, 0, 0]);
        let p = policy();
        let mut counts = [0usize; 4];
        for i in 0..40 {
            counts[pick(&p, &ws, &format!("{i} completely different prompt number {i}")).index] += 1;
        }
        assert_eq!(counts, [10, 10, 10, 10]);
    }

    #[test]
    fn a_matching_prefix_goes_back_to_the_worker_that_holds_it() {
        let (ws, _g) = workers(&[0, 0, 0]);
        let p = policy();
        let first = pick(&p, &ws, "SYSTEM: you are a pirate. USER: hello").index;
        for q in ["how are you", "tell me a joke", "what is rust"] {
            let c = pick(&p, &ws, &format!("SYSTEM: you are a pirate. USER: {q}"));
            assert_eq!(c.index, first);
            assert!(c.match_ratio.unwrap() >= 0.5);
        }
    }

    #[test]
    fn an_overloaded_holder_loses_only_its_own_traffic() {
        let (ws, mut guards) = workers(&[0, 0, 0]);
        let p = policy();
        let a = pick(&p, &ws, "prompt A: long shared system prompt text ... q0").index;
        let b = pick(&p, &ws, "prompt B: another shared system prompt text ... q0").index;
        assert_ne!(a, b);
        // Overload the holder of A: 10 in flight against a minimum of 0 (> 4 and > 1.5 * 0).
        guards.extend((0..10).map(|_| LoadGuard::new(&ws[a])));
        let moved = pick(&p, &ws, "prompt A: long shared system prompt text ... q1");
        assert_ne!(moved.index, a, "an overloaded worker must not get more of its prefix");
        // B's traffic keeps its affinity although the cluster is imbalanced.
        assert_eq!(pick(&p, &ws, "prompt B: another shared system prompt text ... q1").index, b);
    }

    #[test]
    fn small_imbalances_keep_affinity() {
        let (ws, mut guards) = workers(&[0, 0]);
        let p = policy();
        let a = pick(&p, &ws, "prompt A: shared system prompt ... q0").index;
        guards.extend((0..4).map(|_| LoadGuard::new(&ws[a])));
        assert_eq!(pick(&p, &ws, "prompt A: shared system prompt ... q1").index, a, "4 - 0 is not > 4");
    }

    #[test]
    fn replicated_prefix_goes_to_the_lighter_holder() {
        let (ws, mut guards) = workers(&[0, 0]);
        let p = policy();
        p.tree().insert(b"shared prefix xyz", &ws[0].url);
        p.tree().insert(b"shared prefix xyz", &ws[1].url);
        guards.extend((0..2).map(|_| LoadGuard::new(&ws[0])));
        assert_eq!(pick(&p, &ws, "shared prefix xyz + question").index, 1);
    }

    #[test]
    fn replicas_a_few_bytes_apart_share_by_load() {
        let (ws, mut guards) = workers(&[0, 0]);
        let p = policy();
        let sys = "S".repeat(200);
        p.tree().insert(format!("{sys} user 104: a").as_bytes(), &ws[0].url);
        p.tree().insert(format!("{sys} user 2: b").as_bytes(), &ws[1].url);
        guards.push(LoadGuard::new(&ws[0]));
        // w0 matches 2 bytes more of "user 105", but w1 is lighter and holds about as much.
        assert_eq!(pick(&p, &ws, &format!("{sys} user 105: c")).index, 1);
    }

    #[test]
    fn unmatched_text_goes_to_the_least_loaded_worker() {
        let (ws, _g) = workers(&[3, 1, 2]);
        let p = policy();
        assert_eq!(pick(&p, &ws, "brand new text").index, 1);
    }

    #[test]
    fn removed_worker_is_forgotten_and_eviction_bounds_the_tree() {
        let (ws, _g) = workers(&[0, 0]);
        let p = policy();
        let a = pick(&p, &ws, "some text that is held").index;
        p.on_worker_removed(&ws[a].url);
        assert_eq!(p.tree().tenant_size(&ws[a].url), 0);
        let small = CacheAware::new(CacheAwareConfig { max_tree_size: 10, ..p.cfg });
        pick(&small, &ws, "0123456789012345678901234567890123456789");
        small.maintenance();
        assert!(small.tree().sizes().iter().all(|(_, s)| *s <= 10));
    }
}
