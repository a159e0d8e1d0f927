//! Recall of the graph searches, measured in service.
//!
//! An HNSW search is approximate: how often it misses the nearest vector depends on the
//! vectors (embeddings of few effective dimensions are easy, random-like ones are not) and on
//! the partition's size, so no fixed search width suits every deployment. One graph search in
//! [`IndexConfig::recall_check_every`] keeps its query and the best similarity the graph
//! found; maintenance later scans the same slots exactly and counts the search as `missed`
//! when a live vector was closer than what the graph returned. A partition whose checks
//! show its recall under [`IndexConfig::recall_target`] with confidence (the Wilson upper
//! bound of its found share at [`Z`], about 99 % one-sided, under the target, after at
//! least [`MIN_CHECKS`]) searches wider from then on: its search width doubles, up to
//! [`IndexConfig::ef_search_max`], and its count starts again. Evidence older than
//! [`WINDOW`] checks is dropped, so a partition that grows into needing more is seen. The
//! bound, not the observed share, decides: at a true recall just over the target, a share
//! under it in some window of a hundred is common, and widths only grow (until the
//! partition is dropped), so noise would widen every partition in time.
//!
//! Bounded: at most [`MAX_PENDING`] samples wait between two maintenance passes (the rest
//! are not taken), each one query's floats; a check costs one exact scan of its partition,
//! off the request path.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::{IndexConfig, PartitionKey};

/// Checks of a partition kept as evidence at most (then counted again from zero).
pub const WINDOW: u32 = 1_000;
/// Checks before a partition may be widened.
pub const MIN_CHECKS: u32 = 20;
/// Normal quantile of the bound that widens (one-sided, about 99 %).
pub const Z: f64 = 2.326;
/// Samples waiting for maintenance at most.
pub const MAX_PENDING: usize = 64;

/// A graph search kept for a check.
pub(super) struct Sample {
    pub key: PartitionKey,
    pub query: Box<[f32]>,
    /// The best similarity among the live results the graph returned.
    pub found: f32,
    /// Slots the partition had when it was searched: later ones are not compared.
    pub slots: usize,
    /// The partition's epoch then: a rebuild renumbers the slots (and a partition dropped
    /// and made again under the same key is another).
    pub epoch: u64,
}

/// The samples taken, waiting for maintenance.
#[derive(Default)]
pub(super) struct Samples {
    seen: AtomicU64,
    pending: Mutex<Vec<Sample>>,
}

impl Samples {
    /// Counts one graph search and keeps it (made by `sample`) when it is the one in
    /// `every` and room is left.
    pub fn offer(&self, every: u32, sample: impl FnOnce() -> Sample) {
        let seen = self.seen.fetch_add(1, Ordering::Relaxed);
        if every == 0 || !seen.is_multiple_of(u64::from(every)) {
            return;
        }
        let mut pending = self.pending.lock();
        if pending.len() < MAX_PENDING {
            pending.push(sample());
        }
    }

    pub fn take(&self) -> Vec<Sample> {
        std::mem::take(&mut *self.pending.lock())
    }
}

/// A partition's search width and the checks of its current window.
#[derive(Default)]
pub(super) struct Width {
    /// The width its graph searches use; 0 until first widened (the configured one).
    ef: AtomicUsize,
    /// Unique in the index, new at each rebuild (see [`Sample::epoch`]).
    pub epoch: AtomicU64,
    /// Checks and misses in the current window.
    window: Mutex<(u32, u32)>,
}

/// What one check did to its partition.
pub(super) enum Checked {
    Found,
    Missed,
}

impl Width {
    pub fn new(epoch: u64) -> Self {
        Width {
            epoch: AtomicU64::new(epoch),
            ..Width::default()
        }
    }

    /// The width its graph searches use.
    pub fn ef(&self, cfg: &IndexConfig) -> usize {
        match self.ef.load(Ordering::Relaxed) {
            0 => cfg.ef_search,
            ef => ef,
        }
    }

    /// Records a check; once the checks show the partition's recall under the target,
    /// widens its searches (returns the new width and the recall seen).
    pub fn record(&self, checked: Checked, cfg: &IndexConfig) -> Option<(usize, f64)> {
        let mut w = self.window.lock();
        w.0 += 1;
        if matches!(checked, Checked::Missed) {
            w.1 += 1;
        }
        let (n, missed) = (f64::from(w.0), f64::from(w.1));
        let short = w.0 >= MIN_CHECKS && wilson_upper(n - missed, n, Z) < cfg.recall_target;
        let ef = self.ef(cfg);
        if !short || ef >= cfg.ef_search_max {
            if w.0 >= WINDOW {
                *w = (0, 0);
            }
            return None;
        }
        *w = (0, 0);
        let wider = ef.saturating_mul(2).clamp(1, cfg.ef_search_max);
        self.ef.store(wider, Ordering::Relaxed);
        Some((wider, 1.0 - missed / n))
    }
}

/// Wilson score upper bound of the proportion `k / n` at normal quantile `z`.
fn wilson_upper(k: f64, n: f64, z: f64) -> f64 {
    let p = k / n;
    let z2 = z * z;
    let spread = z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((p + z2 / (2.0 * n) + spread) / (1.0 + z2 / n)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn widened_after(misses: &[bool], cfg: &IndexConfig) -> Option<usize> {
        let w = Width::default();
        misses.iter().position(|&m| {
            let c = if m { Checked::Missed } else { Checked::Found };
            w.record(c, cfg).is_some()
        })
    }

    #[test]
    fn a_partition_is_widened_on_evidence_not_on_noise() {
        let cfg = IndexConfig {
            ef_search: 64,
            ef_search_max: 512,
            recall_target: 0.99,
            ..IndexConfig::default()
        };
        // A miss in every ten checks (recall 0.9): widened once the bound is sure of it.
        let tenth: Vec<bool> = (0..1_000).map(|i| i % 10 == 0).collect();
        let at = widened_after(&tenth, &cfg).expect("widened") + 1;
        assert!(
            (MIN_CHECKS as usize..200).contains(&at),
            "after {at} checks"
        );
        // Two misses in a hundred (0.98 seen, a true recall of 0.998 gives that one window
        // in sixty): not widened on it.
        let two: Vec<bool> = (0..100).map(|i| i == 10 || i == 60).collect();
        assert_eq!(widened_after(&two, &cfg), None);
        // A recall of 0.998 over many windows: never widened.
        let rare: Vec<bool> = (0..20_000).map(|i| i % 500 == 7).collect();
        assert_eq!(widened_after(&rare, &cfg), None);
        // Past its widest, never widened.
        let w = Width::default();
        let widest = IndexConfig {
            ef_search_max: 64,
            ..cfg.clone()
        };
        for _ in 0..200 {
            assert!(w.record(Checked::Missed, &widest).is_none());
        }
        assert_eq!(w.ef(&widest), 64);
    }

    #[test]
    fn the_bound_is_wilsons() {
        // 95 of 100 at z 1.96: the upper end of Wilson's interval, 0.9785.
        let u = wilson_upper(95.0, 100.0, 1.96);
        assert!((u - 0.9785).abs() < 1e-3, "{u}");
        assert!((wilson_upper(100.0, 100.0, 2.326) - 1.0).abs() < 1e-9);
    }
}

/// What maintenance's checks found, since the index was created.
#[derive(Default)]
pub(super) struct RecallCounters {
    pub checked: AtomicU64,
    pub missed: AtomicU64,
    pub widened: AtomicU64,
}
