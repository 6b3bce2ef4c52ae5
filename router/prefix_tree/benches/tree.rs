//! `cargo bench -p splitserve-prefix-tree`: insert and match throughput on a workload of shared
//! system prompts with distinct suffixes (the shape cache_aware routing sees), and eviction time.

use prefix_tree::PrefixTree;
use std::time::Instant;

fn main() {
    let prompts: Vec<String> = (0..64).map(|i| format!("You are assistant #{i}. {}", "Be helpful. ".repeat(80))).collect();
    let texts: Vec<Vec<u8>> = (0..20_000)
        .map(|j| format!("{} User {j}: please summarise item {}", prompts[j % 64], j * 7919).into_bytes())
        .collect();
    let tree = PrefixTree::new();
    let start = Instant::now();
    for (j, t) in texts.iter().enumerate() {
        tree.insert(t, ["w0", "w1", "w2", "w3"][j % 4]);
    }
    let ins = start.elapsed();
    let start = Instant::now();
    let mut total = 0usize;
    for t in &texts {
        total += tree.match_tenants(t).lens.len();
    }
    let mat = start.elapsed();
    let start = Instant::now();
    let evicted = tree.evict(20_000);
    let ev = start.elapsed();
    let n = texts.len() as f64;
    let avg = texts.iter().map(Vec::len).sum::<usize>() as f64 / n;
    println!("texts: {} of {avg:.0} bytes on average", texts.len());
    println!("insert: {:.2} us/op", ins.as_secs_f64() * 1e6 / n);
    println!("match:  {:.2} us/op ({total} tenant hits)", mat.as_secs_f64() * 1e6 / n);
    println!("evict to 20 kB/tenant: {:.1} ms ({evicted} bytes)", ev.as_secs_f64() * 1e3);
}
