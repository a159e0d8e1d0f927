//! Recall measured in service: graph searches sampled, checked against exact scans by
//! maintenance, and partitions whose searches miss too often widened.

use std::sync::Arc;

use reprise_cache::semantic::{IndexConfig, PartitionKey, SemanticIndex, RECALL_MAX_PENDING};
use reprise_cache::testing::unit_vector;
use reprise_cache::{EntryId, Vector};

const DIM: usize = 32;
const PART: PartitionKey = [7; 32];

/// An index of `n` random vectors in one partition with its graph built: random vectors
/// are a graph's worst case, so a narrow search misses often.
fn index(cfg: IndexConfig, n: usize) -> (SemanticIndex, Vec<Arc<[f32]>>) {
    let idx = SemanticIndex::new(DIM, cfg);
    let vs = vectors(n, 0x9e37_79b9_7f4a_7c15);
    for (i, v) in vs.iter().enumerate() {
        idx.insert(PART, EntryId(i as u128), Vector::from(v));
    }
    assert_eq!(idx.maintain().rebuilt, 1, "the graph is built");
    assert_eq!(idx.graphs(), 1);
    (idx, vs)
}

fn vectors(n: usize, seed: u64) -> Vec<Arc<[f32]>> {
    // Spread small seeds over the generator's state.
    let mut seed = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| unit_vector(DIM, DIM, &mut seed).into())
        .collect()
}

/// A graph searched one candidate wide, every search sampled.
fn narrow() -> IndexConfig {
    IndexConfig {
        exact_scan_max: 100,
        hnsw_m: 8,
        ef_construction: 32,
        ef_search: 1,
        ef_search_max: 1024,
        recall_check_every: 1,
        recall_target: 0.99,
        ..IndexConfig::default()
    }
}

/// The share of `queries` whose nearest vector (by an exact scan) a search of width `ef`
/// returns first.
fn recall_at(idx: &SemanticIndex, vs: &[Arc<[f32]>], queries: &[Arc<[f32]>], ef: usize) -> f64 {
    let found = queries
        .iter()
        .filter(|q| {
            let best = (0..vs.len())
                .max_by(|&a, &b| {
                    Vector::from(&vs[a])
                        .dot(q)
                        .total_cmp(&Vector::from(&vs[b]).dot(q))
                })
                .unwrap();
            idx.search_wide(&PART, q, 1, Some(ef))
                .first()
                .is_some_and(|c| c.id == EntryId(best as u128))
        })
        .count();
    found as f64 / queries.len() as f64
}

#[test]
fn searches_that_miss_the_nearest_widen_their_partition_until_they_find_it() {
    let (idx, vs) = index(narrow(), 3_000);
    assert_eq!(idx.search_width(&PART), Some(1));
    let mut checked = 0;
    let mut missed = 0;
    let mut widened = 0;
    for round in 0..20u64 {
        for q in vectors(RECALL_MAX_PENDING, round + 1) {
            idx.search(&PART, &q, 1);
        }
        let report = idx.maintain();
        assert_eq!(report.recall_checked, RECALL_MAX_PENDING, "round {round}");
        checked += report.recall_checked;
        missed += report.recall_missed;
        widened += report.widened;
    }
    let stats = idx.graph_stats();
    assert_eq!(stats.recall_checks as usize, checked);
    assert_eq!(stats.recall_misses as usize, missed);
    assert!(missed > 0, "one-wide searches of a sparse graph miss");
    assert!(widened >= 2, "widened {widened} times");
    // Widened step by step, and no further once its searches found the nearest: short of
    // the most it could be widened to.
    let width = idx.search_width(&PART).unwrap();
    assert!((4..=512).contains(&width), "width {width}");
    assert_eq!(idx.widest_search(), width);
    // The widening is what a search needs: the width reached finds the nearest far more
    // often than the configured one.
    let queries = vectors(200, 99);
    let (narrow, wide) = (
        recall_at(&idx, &vs, &queries, 1),
        recall_at(&idx, &vs, &queries, width),
    );
    assert!(
        narrow < 0.5 && wide >= 0.95,
        "recall {narrow} at 1, {wide} at {width}"
    );
}

#[test]
fn a_partition_whose_searches_find_the_nearest_keeps_its_width() {
    // A graph of 300 vectors searched 200 wide is an exhaustive search: no check may call
    // it a miss.
    let cfg = IndexConfig {
        ef_search: 200,
        hnsw_m: 16,
        ..narrow()
    };
    let (idx, _) = index(cfg, 300);
    let mut checked = 0;
    for round in 0..4u64 {
        for q in vectors(RECALL_MAX_PENDING, round + 1) {
            idx.search(&PART, &q, 1);
        }
        let report = idx.maintain();
        assert_eq!(report.recall_missed, 0);
        assert_eq!(report.widened, 0);
        checked += report.recall_checked;
    }
    assert!(checked >= 200, "{checked} checks: past two windows");
    assert_eq!(idx.search_width(&PART), Some(200));
}

#[test]
fn no_search_is_checked_when_checks_are_off_or_the_width_is_given() {
    let cfg = IndexConfig {
        recall_check_every: 0,
        ..narrow()
    };
    let (idx, _) = index(cfg, 1_000);
    for q in vectors(100, 5) {
        idx.search(&PART, &q, 1);
    }
    assert_eq!(idx.maintain().recall_checked, 0);

    // A width the caller gives (a benchmark's) is not the partition's: not sampled.
    let (idx, _) = index(narrow(), 1_000);
    for q in vectors(100, 5) {
        idx.search_wide(&PART, &q, 1, Some(4));
    }
    assert_eq!(idx.maintain().recall_checked, 0);
}

#[test]
fn samples_taken_before_a_rebuild_are_dropped() {
    // After a rebuild the slots are renumbered: a sample of the old numbering would compare
    // the wrong vectors.
    let (idx, _) = index(narrow(), 1_000);
    for q in vectors(10, 3) {
        idx.search(&PART, &q, 1);
    }
    for i in 0..400u128 {
        assert!(idx.remove(EntryId(i)));
    }
    let report = idx.maintain();
    assert_eq!(report.rebuilt, 1, "worn past the tombstone ratio");
    assert_eq!(report.recall_checked, 0);
    // Searches after it are checked again.
    for q in vectors(10, 4) {
        idx.search(&PART, &q, 1);
    }
    assert_eq!(idx.maintain().recall_checked, 10);
}
