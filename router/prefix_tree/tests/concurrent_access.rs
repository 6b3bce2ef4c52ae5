//! The tree under concurrent inserts, matches, evictions and tenant removals from many threads.

use prefix_tree::PrefixTree;
use std::sync::Arc;
use std::thread;

fn text(i: usize, j: usize) -> Vec<u8> {
    format!("shared system prompt {} / user {} asks {}", i % 7, j, i * 31 + j).into_bytes()
}

#[test]
fn concurrent_inserts_are_all_visible_afterwards() {
    let tree = Arc::new(PrefixTree::new());
    let handles: Vec<_> = (0..8)
        .map(|w| {
            let tree = tree.clone();
            thread::spawn(move || {
                let name = format!("w{w}");
                for i in 0..400 {
                    let t = text(i, w);
                    tree.insert(&t, &name);
                    assert_eq!(tree.match_tenants(&t).len_for(&name), t.len());
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    tree.check_invariants().unwrap();
    for w in 0..8 {
        for i in 0..400 {
            let t = text(i, w);
            assert_eq!(tree.match_tenants(&t).len_for(&format!("w{w}")), t.len());
        }
    }
}

#[test]
fn eviction_and_removal_racing_with_traffic_keep_the_tree_consistent() {
    let tree = Arc::new(PrefixTree::new());
    let mut handles: Vec<_> = (0..4)
        .map(|w| {
            let tree = tree.clone();
            thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(w as u64);
                for i in 0..2000 {
                    let t = text(rng.usize(..50), i % 13);
                    let name = format!("w{}", rng.usize(..6));
                    if rng.bool() {
                        tree.insert(&t, &name);
                    } else {
                        let m = tree.match_tenants(&t);
                        assert!(m.lens.iter().all(|(_, l)| *l <= t.len()));
                    }
                }
            })
        })
        .collect();
    {
        let tree = tree.clone();
        handles.push(thread::spawn(move || {
            for round in 0..200 {
                tree.evict(500);
                if round % 50 == 49 {
                    tree.remove_tenant("w5");
                }
                tree.check_invariants().unwrap();
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    tree.check_invariants().unwrap();
    tree.evict(500);
    for (name, size) in tree.sizes() {
        assert!(size <= 500, "{name} holds {size} bytes after eviction");
    }
}
