//! An exact share of events: [`ExactShare::take`] says yes to `share` of the calls, every
//! n-th (call n is taken when ⌊(n+1)·share⌋ steps up), so the share is exact at any count and
//! nothing random makes a test or a canary drift.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts events and takes an exact share of them.
#[derive(Debug, Default)]
pub struct ExactShare(AtomicU64);

impl ExactShare {
    /// Whether this event is among the `share` (0 to 1) taken.
    pub fn take(&self, share: f64) -> bool {
        let n = self.0.fetch_add(1, Ordering::Relaxed) as f64;
        ((n + 1.0) * share).floor() > (n * share).floor()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_exactly_its_share() {
        for share in [0.0, 0.01, 0.25, 0.5, 0.99, 1.0] {
            let s = ExactShare::default();
            let n = (0..1000).filter(|_| s.take(share)).count();
            assert_eq!(n as f64, (share * 1000.0).floor(), "{share}");
        }
    }
}
