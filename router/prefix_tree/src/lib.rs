//! An approximate prefix tree of request text, shared by all tenants (workers).
//!
//! The router cannot see a worker's real radix cache, so it keeps its own estimate: every request
//! text routed to a worker is inserted under that worker's name ("tenant"). `match_tenants`
//! returns, per tenant, how many leading bytes of a new request that tenant has already seen.
//!
//! Structure: a compressed radix tree over bytes in an arena (`Vec<Node>` with a free list).
//! Every non-root node carries the tenants that hold its whole edge, each with the logical time
//! of the last insert through it. Invariants (checked by `check_invariants`):
//! * a child's tenants are a subset of its parent's tenants (a tenant holds whole prefixes);
//! * no non-root node is without tenants, and no edge is empty;
//! * a tenant's size is the sum of the edge lengths of the nodes it holds.
//!
//! Eviction is LRU at byte granularity: while a tenant holds more than the limit, the tenant's
//! least recently used leaf (a node it holds where no child is held by it) gives up bytes from
//! its end, splitting the node when only part of it must go. A single `RwLock` guards the tree:
//! matches share it, inserts and evictions take it exclusively. Each operation is O(text length)
//! except eviction and tenant removal, which scan the arena and run in the background.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

type Tid = u16;
const ROOT: u32 = 0;

#[derive(Debug, Default)]
struct Node {
    edge: Vec<u8>,
    parent: u32,
    /// Sorted by first byte of the child's edge.
    children: Vec<(u8, u32)>,
    /// Tenants holding this whole edge, with the logical time of their last insert through it.
    tenants: Vec<(Tid, u64)>,
}

impl Node {
    fn has(&self, t: Tid) -> bool {
        self.tenants.iter().any(|&(x, _)| x == t)
    }
    fn stamp(&self, t: Tid) -> Option<u64> {
        self.tenants.iter().find(|&&(x, _)| x == t).map(|&(_, s)| s)
    }
}

#[derive(Debug, Default)]
struct Inner {
    nodes: Vec<Node>,
    free: Vec<u32>,
    names: Vec<Option<Arc<str>>>,
    ids: HashMap<Arc<str>, Tid>,
    sizes: Vec<usize>,
    clock: u64,
}

/// Per-tenant match lengths for one query, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    pub lens: Vec<(Arc<str>, usize)>,
}

impl Matches {
    /// Matched bytes for `tenant` (0 if it matched nothing).
    pub fn len_for(&self, tenant: &str) -> usize {
        self.lens.iter().find(|(t, _)| &**t == tenant).map_or(0, |(_, l)| *l)
    }
}

/// The thread-safe tree. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct PrefixTree {
    inner: RwLock<Inner>,
}

impl Default for PrefixTree {
    fn default() -> Self {
        Self::new()
    }
}

fn lcp(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Inner {
    fn new() -> Self {
        Inner { nodes: vec![Node::default()], ..Default::default() }
    }

    fn child(&self, n: u32, b: u8) -> Option<u32> {
        let ch = &self.nodes[n as usize].children;
        ch.binary_search_by_key(&b, |&(k, _)| k).ok().map(|i| ch[i].1)
    }

    fn alloc(&mut self, node: Node) -> u32 {
        if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn attach(&mut self, parent: u32, child: u32) {
        let b = self.nodes[child as usize].edge[0];
        let ch = &mut self.nodes[parent as usize].children;
        match ch.binary_search_by_key(&b, |&(k, _)| k) {
            Ok(i) => ch[i].1 = child,
            Err(i) => ch.insert(i, (b, child)),
        }
        self.nodes[child as usize].parent = parent;
    }

    fn detach(&mut self, child: u32) {
        let parent = self.nodes[child as usize].parent;
        let b = self.nodes[child as usize].edge[0];
        let ch = &mut self.nodes[parent as usize].children;
        if let Ok(i) = ch.binary_search_by_key(&b, |&(k, _)| k) {
            ch.remove(i);
        }
    }

    /// Splits node `n` after `k` bytes (0 < k < edge len); returns the new lower node.
    fn split(&mut self, n: u32, k: usize) -> u32 {
        let node = &mut self.nodes[n as usize];
        let tail = node.edge.split_off(k);
        let lower = Node {
            edge: tail,
            parent: n,
            children: std::mem::take(&mut node.children),
            tenants: node.tenants.clone(),
        };
        let lower_id = self.alloc(lower);
        let grandchildren: Vec<u32> =
            self.nodes[lower_id as usize].children.iter().map(|&(_, c)| c).collect();
        for c in grandchildren {
            self.nodes[c as usize].parent = lower_id;
        }
        let b = self.nodes[lower_id as usize].edge[0];
        self.nodes[n as usize].children = vec![(b, lower_id)];
        lower_id
    }

    fn tenant_id(&mut self, name: &str) -> Tid {
        if let Some(&t) = self.ids.get(name) {
            return t;
        }
        let name: Arc<str> = Arc::from(name);
        let t = match self.names.iter().position(Option::is_none) {
            Some(i) => {
                self.names[i] = Some(name.clone());
                self.sizes[i] = 0;
                i as Tid
            }
            None => {
                assert!(self.names.len() < Tid::MAX as usize, "too many tenants");
                self.names.push(Some(name.clone()));
                self.sizes.push(0);
                (self.names.len() - 1) as Tid
            }
        };
        self.ids.insert(name, t);
        t
    }

    fn touch(&mut self, n: u32, t: Tid, ts: u64) {
        let node = &mut self.nodes[n as usize];
        if let Some(e) = node.tenants.iter_mut().find(|(x, _)| *x == t) {
            e.1 = ts;
        } else {
            node.tenants.push((t, ts));
            self.sizes[t as usize] += node.edge.len();
        }
    }

    fn insert(&mut self, text: &[u8], tenant: &str) {
        let t = self.tenant_id(tenant);
        self.clock += 1;
        let ts = self.clock;
        let (mut node, mut pos) = (ROOT, 0usize);
        while pos < text.len() {
            match self.child(node, text[pos]) {
                None => {
                    let leaf = Node {
                        edge: text[pos..].to_vec(),
                        parent: node,
                        children: Vec::new(),
                        tenants: vec![(t, ts)],
                    };
                    self.sizes[t as usize] += leaf.edge.len();
                    let id = self.alloc(leaf);
                    self.attach(node, id);
                    return;
                }
                Some(c) => {
                    let k = lcp(&self.nodes[c as usize].edge, &text[pos..]);
                    if k < self.nodes[c as usize].edge.len() {
                        self.split(c, k);
                    }
                    self.touch(c, t, ts);
                    pos += k;
                    node = c;
                }
            }
        }
    }

    fn match_tenants(&self, text: &[u8]) -> Matches {
        let mut lens = vec![0usize; self.names.len()];
        let (mut node, mut pos) = (ROOT, 0usize);
        while pos < text.len() {
            let Some(c) = self.child(node, text[pos]) else { break };
            let n = &self.nodes[c as usize];
            let k = lcp(&n.edge, &text[pos..]);
            pos += k;
            for &(t, _) in &n.tenants {
                lens[t as usize] = pos;
            }
            if k < n.edge.len() {
                break;
            }
            node = c;
        }
        let lens = lens
            .into_iter()
            .enumerate()
            .filter(|&(_, l)| l > 0)
            .filter_map(|(t, l)| self.names[t].clone().map(|n| (n, l)))
            .collect();
        Matches { lens }
    }

    /// Frees `n` and its whole subtree (used for nodes no tenant holds any more).
    fn free_subtree(&mut self, n: u32) {
        let mut stack = vec![n];
        while let Some(x) = stack.pop() {
            let node = std::mem::take(&mut self.nodes[x as usize]);
            stack.extend(node.children.iter().map(|&(_, c)| c));
            self.free.push(x);
        }
    }

    fn is_leaf_for(&self, n: u32, t: Tid) -> bool {
        let node = &self.nodes[n as usize];
        node.has(t) && !node.children.iter().any(|&(_, c)| self.nodes[c as usize].has(t))
    }

    fn live_nodes(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(x) = stack.pop() {
            if x != ROOT {
                out.push(x);
            }
            stack.extend(self.nodes[x as usize].children.iter().map(|&(_, c)| c));
        }
        out
    }

    fn evict_tenant(&mut self, t: Tid, max: usize) -> usize {
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .live_nodes()
            .into_iter()
            .filter(|&n| self.is_leaf_for(n, t))
            .filter_map(|n| self.nodes[n as usize].stamp(t).map(|s| Reverse((s, n))))
            .collect();
        let mut evicted = 0;
        while self.sizes[t as usize] > max {
            let Some(Reverse((_, n))) = heap.pop() else { break };
            let excess = self.sizes[t as usize] - max;
            let len = self.nodes[n as usize].edge.len();
            let victim = if excess < len { self.split(n, len - excess) } else { n };
            let vlen = self.nodes[victim as usize].edge.len();
            let p = self.nodes[victim as usize].parent;
            self.nodes[victim as usize].tenants.retain(|&(x, _)| x != t);
            self.sizes[t as usize] -= vlen;
            evicted += vlen;
            if self.nodes[victim as usize].tenants.is_empty() {
                self.detach(victim);
                self.free_subtree(victim);
            }
            // A split leaves `n` holding t below the limit; a whole node may expose its parent.
            if victim == n {
                if p != ROOT && self.is_leaf_for(p, t) {
                    if let Some(s) = self.nodes[p as usize].stamp(t) {
                        heap.push(Reverse((s, p)));
                    }
                }
            }
        }
        evicted
    }

    fn remove_tenant(&mut self, name: &str) {
        let Some(t) = self.ids.remove(name) else { return };
        let mut stack = vec![ROOT];
        while let Some(x) = stack.pop() {
            let children: Vec<u32> = self.nodes[x as usize].children.iter().map(|&(_, c)| c).collect();
            for c in children {
                self.nodes[c as usize].tenants.retain(|&(y, _)| y != t);
                if self.nodes[c as usize].tenants.is_empty() {
                    self.detach(c);
                    self.free_subtree(c);
                } else {
                    stack.push(c);
                }
            }
        }
        self.names[t as usize] = None;
        self.sizes[t as usize] = 0;
    }
}

impl PrefixTree {
    pub fn new() -> Self {
        PrefixTree { inner: RwLock::new(Inner::new()) }
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that `tenant` has seen `text` (and so every prefix of it).
    pub fn insert(&self, text: &[u8], tenant: &str) {
        if !text.is_empty() {
            self.write().insert(text, tenant);
        }
    }

    /// For every tenant, the length of the longest prefix of `text` it holds (zeros left out).
    pub fn match_tenants(&self, text: &[u8]) -> Matches {
        self.read().match_tenants(text)
    }

    /// Bytes held by `tenant`.
    pub fn tenant_size(&self, tenant: &str) -> usize {
        let g = self.read();
        g.ids.get(tenant).map_or(0, |&t| g.sizes[t as usize])
    }

    /// Every tenant with its size in bytes.
    pub fn sizes(&self) -> Vec<(Arc<str>, usize)> {
        let g = self.read();
        g.ids.iter().map(|(n, &t)| (n.clone(), g.sizes[t as usize])).collect()
    }

    /// Evicts least recently used bytes until every tenant holds at most `max_per_tenant` bytes.
    /// Returns the number of bytes evicted.
    pub fn evict(&self, max_per_tenant: usize) -> usize {
        let mut g = self.write();
        let over: Vec<Tid> =
            g.ids.values().copied().filter(|&t| g.sizes[t as usize] > max_per_tenant).collect();
        over.into_iter().map(|t| g.evict_tenant(t, max_per_tenant)).sum()
    }

    /// Forgets a tenant entirely (its worker was removed).
    pub fn remove_tenant(&self, tenant: &str) {
        self.write().remove_tenant(tenant);
    }

    /// Forgets everything (the workers' caches were flushed).
    pub fn clear(&self) {
        *self.write() = Inner::new();
    }

    /// Number of live nodes, root excluded.
    pub fn node_count(&self) -> usize {
        self.read().live_nodes().len()
    }

    /// Verifies the structural invariants; for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let g = self.read();
        let mut sizes = vec![0usize; g.names.len()];
        for n in g.live_nodes() {
            let node = &g.nodes[n as usize];
            if node.edge.is_empty() {
                return Err(format!("node {n} has an empty edge"));
            }
            if node.tenants.is_empty() {
                return Err(format!("node {n} has no tenants"));
            }
            let parent = &g.nodes[node.parent as usize];
            if !parent.children.iter().any(|&(b, c)| c == n && b == node.edge[0]) {
                return Err(format!("node {n} is not linked from its parent"));
            }
            for &(t, _) in &node.tenants {
                if node.parent != ROOT && !parent.has(t) {
                    return Err(format!("tenant {t} holds node {n} but not its parent"));
                }
                sizes[t as usize] += node.edge.len();
            }
            if !node.children.windows(2).all(|w| w[0].0 < w[1].0) {
                return Err(format!("children of node {n} are not sorted"));
            }
        }
        for (t, name) in g.names.iter().enumerate() {
            if name.is_some() && sizes[t] != g.sizes[t] {
                return Err(format!("tenant {t}: size {} but nodes hold {}", g.sizes[t], sizes[t]));
            }
        }
        Ok(())
    }
}
