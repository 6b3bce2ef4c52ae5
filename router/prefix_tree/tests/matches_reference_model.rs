//! Differential test: the compressed tree against a deliberately naive model that stores every
//! prefix of every inserted text explicitly, driven by seeded random insert/match/evict/remove
//! streams. Both must agree exactly on every match and every tenant size.

use prefix_tree::PrefixTree;
use std::collections::HashMap;

/// prefix -> (tenant -> logical time of the last insert through it)
#[derive(Default)]
struct Model {
    prefixes: HashMap<Vec<u8>, HashMap<String, u64>>,
    clock: u64,
}

impl Model {
    fn insert(&mut self, text: &[u8], tenant: &str) {
        if text.is_empty() {
            return;
        }
        self.clock += 1;
        for i in 1..=text.len() {
            self.prefixes.entry(text[..i].to_vec()).or_default().insert(tenant.to_string(), self.clock);
        }
    }

    fn match_len(&self, text: &[u8], tenant: &str) -> usize {
        (1..=text.len())
            .rev()
            .find(|&i| self.prefixes.get(&text[..i]).is_some_and(|m| m.contains_key(tenant)))
            .unwrap_or(0)
    }

    fn size(&self, tenant: &str) -> usize {
        self.prefixes.values().filter(|m| m.contains_key(tenant)).count()
    }

    fn is_leaf(&self, p: &[u8], tenant: &str) -> bool {
        !self.prefixes.iter().any(|(q, m)| {
            q.len() == p.len() + 1 && q.starts_with(p) && m.contains_key(tenant)
        })
    }

    fn evict(&mut self, max: usize) {
        let tenants: Vec<String> =
            self.prefixes.values().flat_map(|m| m.keys().cloned()).collect::<std::collections::HashSet<_>>().into_iter().collect();
        for t in tenants {
            while self.size(&t) > max {
                let victim = self
                    .prefixes
                    .iter()
                    .filter(|(p, m)| m.contains_key(&t) && self.is_leaf(p, &t))
                    .min_by_key(|(_, m)| m[&t])
                    .map(|(p, _)| p.clone())
                    .expect("a tenant with bytes has a leaf");
                let m = self.prefixes.get_mut(&victim).unwrap();
                m.remove(&t);
                if m.is_empty() {
                    self.prefixes.remove(&victim);
                }
            }
        }
    }

    fn remove_tenant(&mut self, tenant: &str) {
        for m in self.prefixes.values_mut() {
            m.remove(tenant);
        }
        self.prefixes.retain(|_, m| !m.is_empty());
    }
}

const TENANTS: [&str; 4] = ["w0", "w1", "w2", "w3"];

fn random_text(rng: &mut fastrand::Rng, stems: &[Vec<u8>]) -> Vec<u8> {
    // Mostly a shared stem plus a short random tail, over a tiny alphabet so that texts collide.
    let mut t = if rng.u8(..10) < 8 { stems[rng.usize(..stems.len())].clone() } else { Vec::new() };
    let keep = rng.usize(..=t.len());
    t.truncate(keep);
    for _ in 0..rng.usize(..6) {
        t.push(b"abc\xc3\xa9"[rng.usize(..4)]);
    }
    t
}

fn run_stream(seed: u64, ops: usize) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let stems: Vec<Vec<u8>> =
        (0..5).map(|_| (0..rng.usize(3..14)).map(|_| b"abcd"[rng.usize(..4)]).collect()).collect();
    let tree = PrefixTree::new();
    let mut model = Model::default();
    for step in 0..ops {
        let tenant = TENANTS[rng.usize(..TENANTS.len())];
        match rng.u8(..100) {
            0..=49 => {
                let text = random_text(&mut rng, &stems);
                tree.insert(&text, tenant);
                model.insert(&text, tenant);
            }
            50..=84 => {
                let text = random_text(&mut rng, &stems);
                let got = tree.match_tenants(&text);
                for t in TENANTS {
                    assert_eq!(
                        got.len_for(t),
                        model.match_len(&text, t),
                        "seed {seed} step {step}: match of {text:?} for {t}"
                    );
                }
            }
            85..=95 => {
                let max = rng.usize(..40);
                tree.evict(max);
                model.evict(max);
            }
            _ => {
                tree.remove_tenant(tenant);
                model.remove_tenant(tenant);
            }
        }
        if let Err(e) = tree.check_invariants() {
            panic!("seed {seed} step {step}: {e}");
        }
        for t in TENANTS {
            assert_eq!(tree.tenant_size(t), model.size(t), "seed {seed} step {step}: size of {t}");
        }
    }
}

#[test]
fn random_streams_agree_with_the_reference_model() {
    for seed in 0..60 {
        run_stream(seed, 300);
    }
}

#[test]
fn eviction_takes_least_recently_inserted_bytes_first() {
    let tree = PrefixTree::new();
    tree.insert(b"system prompt A: question 1", "w0");
    tree.insert(b"system prompt B: question 2", "w0");
    tree.insert(b"system prompt A: question 3", "w0");
    let before = tree.tenant_size("w0");
    tree.evict(before - 10);
    assert_eq!(tree.tenant_size("w0"), before - 10);
    // B's tail was oldest, so it lost bytes; A's texts are still whole.
    let m = tree.match_tenants(b"system prompt A: question 3");
    assert_eq!(m.len_for("w0"), "system prompt A: question 3".len());
    assert!(tree.match_tenants(b"system prompt B: question 2").len_for("w0") < 27);
    tree.check_invariants().unwrap();
}

#[test]
fn removed_tenant_matches_nothing_and_frees_its_nodes() {
    let tree = PrefixTree::new();
    tree.insert(b"hello world", "a");
    tree.insert(b"hello there", "b");
    tree.remove_tenant("a");
    assert_eq!(tree.match_tenants(b"hello world").len_for("a"), 0);
    assert_eq!(tree.match_tenants(b"hello world").len_for("b"), 6);
    assert_eq!(tree.tenant_size("b"), "hello there".len());
    tree.check_invariants().unwrap();
    tree.clear();
    assert_eq!(tree.node_count(), 0);
}
