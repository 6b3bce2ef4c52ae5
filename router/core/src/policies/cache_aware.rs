//! cache_aware — for each routable worker w let
//!   m_w = (bytes of the request text matched in w's part of the approximate prefix tree) / (text bytes)
//!   L_w = requests in flight from this router to w (counted from dispatch until the response
//!         ends, by a guard, so streams and errors are included), L_min = min_w L_w
//!   S_w = w's recent share of the requests this policy routed (decayed count, ledger.rs) over
//!         the mean share; C_w = w shed a prefix within the last COOLDOWN (64) decisions
//!   overloaded(w) := L_w - L_min > balance_abs_threshold  AND  L_w > balance_rel_threshold * L_min
//!   shed(w)       := overloaded(w) AND S_w > 1 + SHARE_MARGIN (0.05) AND NOT C_w
//!   A = { w : m_w >= cache_threshold AND NOT shed(w) },  m_A = max_{w in A} m_w
//!   B = { w in A : m_w >= m_A - NEAR }   (NEAR = 0.05: matches a few bytes apart are equal)
//! choose argmin_{w in B} L_w if A is not empty (affinity: the longest match, and among
//! workers holding about as much of the text the lightest, so a prefix held by several workers
//! spreads over them instead of following whichever saw a slightly longer suffix). Otherwise
//! place the text: among the workers with L_w - L_min <= balance_abs_threshold, the one whose
//! part of the tree is smallest, then the lightest, ties broken by a rotating start (texts
//! nobody holds, arriving one by one, go round the workers instead of piling onto one, and
//! new prefixes spread evenly over the workers). The chosen worker then holds the text; if it
//! got the text because its holders shed it, it is entered as holding it only after its
//! typical request duration ("warming"), so that the requests that follow keep going to the
//! workers that have the pages instead of recomputing the prefix a second and third time.
//!
//! Why shedding needs more than an instantaneous overload: sending a request away from the
//! worker holding its prefix costs a full prefill elsewhere and a second copy of the prefix.
//! In-flight counts swing widely on their own (Poisson bursts; a batching engine that finishes
//! a whole batch drops to zero for a moment), and reacting to every swing replicated nearly
//! every prefix (measured: hit rate 0.82 against an ideal 0.88 at 4 req/s on two engines).
//! A worker sheds only while it is overloaded now AND has carried more than its share of
//! recent traffic (the imbalance is structural, not a swing), and at most one prefix per
//! cooldown, since one copy moves a whole prefix's traffic and the shares take a while to show
//! it. An overloaded worker loses only requests that would have gone to it, so load imbalance
//! never switches the whole cluster to load balancing. The tree is bounded: every
//! --eviction-interval-secs each worker's part is trimmed to --max-tree-size bytes, least
//! recently used bytes first.

use super::ledger::{Ledger, Warming};
use super::{argmin_rotating, Choice, Policy, RouteRequest};
use crate::config::RouterConfig;
use crate::worker::Worker;
use prefix_tree::PrefixTree;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Matched shares closer than this to the best one count as equally good.
const NEAR: f64 = 0.05;
/// How far above its fair share of recent traffic an overloaded worker must be to shed.
const SHARE_MARGIN: f64 = 0.05;

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
    ledger: Mutex<Ledger>,
    rotation: AtomicUsize,
}

impl CacheAware {
    pub fn new(cfg: CacheAwareConfig) -> Self {
        CacheAware { cfg, tree: PrefixTree::new(), ledger: Mutex::default(), rotation: AtomicUsize::new(0) }
    }

    pub fn tree(&self) -> &PrefixTree {
        &self.tree
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn overloaded(&self, load: usize, min_load: usize) -> bool {
        load - min_load > self.cfg.balance_abs_threshold
            && load as f64 > self.cfg.balance_rel_threshold * min_load as f64
    }

    /// `select` with the clock as an argument (tests drive it).
    pub fn select_at(&self, workers: &[Arc<Worker>], req: &RouteRequest<'_>, now: Instant) -> Option<Choice> {
        if workers.is_empty() {
            return None;
        }
        let text = req.text.unwrap_or_default();
        let mut ledger = self.ledger();
        for w in ledger.take_ready(now) {
            self.tree.insert(&w.text, &w.worker);
        }
        let loads: Vec<usize> = workers.iter().map(|w| w.load()).collect();
        let min_load = loads.iter().copied().min().unwrap_or(0);
        let standing = ledger.standings(workers);
        let shed: Vec<bool> = (0..workers.len())
            .map(|i| self.overloaded(loads[i], min_load) && standing[i].share_ratio > 1.0 + SHARE_MARGIN && !standing[i].cooling)
            .collect();
        let ratios: Vec<f64> = if text.is_empty() {
            vec![0.0; workers.len()]
        } else {
            let m = self.tree.match_tenants(text);
            workers.iter().map(|w| m.len_for(&w.url) as f64 / text.len() as f64).collect()
        };
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        let held = |i: usize| ratios[i] >= self.cfg.cache_threshold && ratios[i] > 0.0;
        let affine = |i: usize| held(i) && !shed[i];
        let best = (0..workers.len()).filter(|&i| affine(i)).map(|i| ratios[i]).fold(f64::NAN, f64::max);
        let shedding = best.is_nan() && (0..workers.len()).any(held);
        let index = if !best.is_nan() {
            let near = |i: usize| affine(i) && ratios[i] >= best - NEAR;
            argmin_rotating(workers.len(), start, |i| if near(i) { (loads[i], -ratios[i]) } else { (usize::MAX, 0.0) })?
        } else {
            let sizes: Vec<usize> = workers.iter().map(|w| self.tree.tenant_size(&w.url)).collect();
            let busy = |i: usize| loads[i] - min_load > self.cfg.balance_abs_threshold;
            argmin_rotating(workers.len(), start, |i| (busy(i), sizes[i], loads[i]))?
        };
        let chosen = &workers[index];
        if shedding {
            for i in (0..workers.len()).filter(|&i| held(i)) {
                ledger.shed(&workers[i].url);
            }
            match chosen.typical_duration() {
                Some(d) if !text.is_empty() => ledger.warm(Warming { worker: chosen.url.clone(), text: text.to_vec(), ready: now + d }),
                _ => self.tree.insert(text, &chosen.url),
            }
        } else if !text.is_empty() {
            self.tree.insert(text, &chosen.url);
        }
        ledger.record(workers, &chosen.url);
        drop(ledger);
        tracing::debug!(worker = %chosen.url, ?loads, ?ratios, ?shed, shedding, affinity = !best.is_nan(), "cache_aware choice");
        Some(Choice { index, match_ratio: Some(ratios[index]) })
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
        self.select_at(workers, req, Instant::now())
    }

    fn on_worker_removed(&self, url: &str) {
        self.tree.remove_tenant(url);
        self.ledger().forget(url);
    }

    fn reset(&self) {
        self.tree.clear();
        self.ledger().clear();
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
    use std::time::Duration;

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

    const A: &str = "prompt A: long shared system prompt text, the same for a whole tenant ... q";
    const B: &str = "prompt B: another shared system prompt text for another tenant ...... q";

    /// Two workers, A's prefix on one and B's on the other, after `a_requests` requests for A
    /// and `b_requests` for B (so the holders' shares of recent traffic are in that ratio).
    fn two_tenants(p: &CacheAware, ws: &[Arc<Worker>], a_requests: usize, b_requests: usize) -> (usize, usize) {
        let a = pick(p, ws, &format!("{A}0")).index;
        let b = pick(p, ws, &format!("{B}0")).index;
        assert_ne!(a, b, "new prefixes are placed on different workers");
        for i in 1..a_requests.max(b_requests) {
            if i < a_requests {
                assert_eq!(pick(p, ws, &format!("{A}{i}")).index, a);
            }
            if i < b_requests {
                assert_eq!(pick(p, ws, &format!("{B}{i}")).index, b);
            }
        }
        (a, b)
    }

    /// `two_tenants` with A's holder at 3× B's traffic and overloaded now: 10 in flight against
    /// 0 (> 4 and > 1.5 * 0). The guards hold the load.
    fn busy_holder() -> (Vec<Arc<Worker>>, Vec<LoadGuard>, CacheAware, usize, usize) {
        let (ws, mut guards) = workers(&[0, 0]);
        let p = policy();
        let (a, b) = two_tenants(&p, &ws, 30, 10);
        guards.extend((0..10).map(|_| LoadGuard::new(&ws[a])));
        (ws, guards, p, a, b)
    }

    #[test]
    fn an_overloaded_worker_with_more_than_its_share_sheds_only_its_own_prefix() {
        let (ws, _g, p, _, b) = busy_holder();
        let moved = pick(&p, &ws, &format!("{A}x"));
        assert_eq!(moved.index, b, "an overloaded worker carrying more than its share sheds its prefix");
        // B's traffic keeps its affinity although the cluster is imbalanced.
        assert_eq!(pick(&p, &ws, &format!("{B}x")).index, b);
    }

    #[test]
    fn a_burst_on_a_worker_with_its_fair_share_keeps_affinity() {
        let (ws, mut guards) = workers(&[0, 0]);
        let p = policy();
        let (a, _) = two_tenants(&p, &ws, 20, 30);
        // A burst: 10 in flight against 0, but A's holder has had less than its share of traffic.
        guards.extend((0..10).map(|_| LoadGuard::new(&ws[a])));
        for i in 0..5 {
            assert_eq!(pick(&p, &ws, &format!("{A}burst {i}")).index, a);
        }
    }

    #[test]
    fn a_worker_that_shed_a_prefix_keeps_its_others_during_the_cooldown() {
        let (ws, _g, p, a, b) = busy_holder();
        let c = "prompt C: a third tenant prompt, also placed on the busy worker ... q";
        p.tree().insert(format!("{c}0").as_bytes(), &ws[a].url);
        assert_eq!(pick(&p, &ws, &format!("{A}x")).index, b, "first shed");
        assert_eq!(pick(&p, &ws, &format!("{c}1")).index, a, "no second shed within the cooldown");
    }

    #[test]
    fn a_shed_copy_warms_up_before_it_takes_a_share_of_the_prefix() {
        let (ws, mut guards, p, a, b) = busy_holder();
        ws[b].record_duration(Duration::from_millis(200));
        let t0 = Instant::now();
        let req = |s: String| s.into_bytes();
        let first = req(format!("{A}shed"));
        assert_eq!(p.select_at(&ws, &RouteRequest { text: Some(&first) }, t0).unwrap().index, b);
        // The copy on b is still being computed: A's requests go back to a (cooling down).
        let next = req(format!("{A}next"));
        let c = p.select_at(&ws, &RouteRequest { text: Some(&next) }, t0 + Duration::from_millis(50)).unwrap();
        assert_eq!(c.index, a);
        // Once b has had time to finish it, both hold A and the lighter one gets it.
        guards.clear();
        guards.extend((0..2).map(|_| LoadGuard::new(&ws[a])));
        let later = req(format!("{A}later"));
        let c = p.select_at(&ws, &RouteRequest { text: Some(&later) }, t0 + Duration::from_millis(250)).unwrap();
        assert_eq!(c.index, b);
        assert!(c.match_ratio.unwrap() > 0.9);
    }

    #[test]
    fn new_prefixes_go_to_the_worker_holding_the_least_text_unless_it_is_busy() {
        let (ws, mut guards) = workers(&[0, 0, 0]);
        let p = policy();
        p.tree().insert(&[b'x'; 300], &ws[0].url);
        p.tree().insert(&[b'y'; 100], &ws[1].url);
        p.tree().insert(&[b'z'; 200], &ws[2].url);
        guards.push(LoadGuard::new(&ws[1]));
        assert_eq!(pick(&p, &ws, "a brand new prefix").index, 1, "one more in flight is not busy");
        guards.extend((0..5).map(|_| LoadGuard::new(&ws[1])));
        assert_eq!(pick(&p, &ws, "another brand new prefix").index, 2, "6 - 0 in flight is busy (> 4)");
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
