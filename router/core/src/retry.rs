//! Exponential backoff with jitter between attempts:
//! delay(n) = min(initial * multiplier^n, max) * (1 + jitter * U(-1, 1)).

use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub initial_ms: u64,
    pub max_ms: u64,
    pub multiplier: f64,
    pub jitter: f64,
}

impl Backoff {
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = (self.initial_ms as f64 * self.multiplier.powi(attempt as i32)).min(self.max_ms as f64);
        let j = 1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0);
        Duration::from_secs_f64((base * j).max(0.0) / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_is_capped_and_jitters_within_bounds() {
        let b = Backoff { initial_ms: 100, max_ms: 1000, multiplier: 2.0, jitter: 0.2 };
        for _ in 0..200 {
            let d0 = b.delay(0).as_secs_f64() * 1000.0;
            let d2 = b.delay(2).as_secs_f64() * 1000.0;
            let d9 = b.delay(9).as_secs_f64() * 1000.0;
            assert!((80.0..=120.0).contains(&d0), "{d0}");
            assert!((320.0..=480.0).contains(&d2), "{d2}");
            assert!((800.0..=1200.0).contains(&d9), "{d9}");
        }
        let spread: std::collections::HashSet<u128> = (0..50).map(|_| b.delay(1).as_micros()).collect();
        assert!(spread.len() > 10, "jitter must vary the delay");
    }
}
