//! What the semantic index adds to memory per entry, counted exactly by a counting allocator
//! (this test binary's global allocator; its tests count one at a time, so nothing else
//! allocates meanwhile).
//!
//! The vectors are made before counting, as the cache's entries hold their embeddings; the
//! index must hold them without copying, so what it adds per entry does not grow with the
//! vector's size: the same entries at 8 dimensions and padded with zeros to 384 (the same
//! similarities, so the same graph) cost the index the same, within a fraction of one
//! vector's floats.
//!
//! Random vectors in all 384 dimensions are the graph's worst case (its pruning keeps the
//! most links when no neighbour is near another): an entry's vector and index stay within
//! 3 KB there too, and what the memory budget charges an indexed entry covers it.

use reprise_cache::semantic::{IndexConfig, SemanticIndex};
use reprise_cache::testing::{unit_vector, CountingAllocator};
use reprise_cache::{EntryId, Vector};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

/// Held by each test: the counter is the whole process's, so they count one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

const ENTRIES: usize = 3000;

/// `n` unit vectors with `random` random components, padded with zeros to `dim`.
fn unit_vectors(dim: usize, random: usize, n: usize) -> Vec<Vector> {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    (0..n)
        .map(|_| unit_vector(dim, random, &mut seed).into())
        .collect()
}

/// Bytes per entry once `ENTRIES` vectors of `dim` components (`random` of them random) are
/// loaded in one partition (past the exact-scan limit) and its graph is built with `cfg`:
/// (the vectors themselves, what the index adds).
fn bytes_per_entry(dim: usize, random: usize, cfg: IndexConfig) -> (f64, f64) {
    let start = HEAP.live();
    let vectors = unit_vectors(dim, random, ENTRIES);
    let before = HEAP.live();
    let index = SemanticIndex::new(dim, cfg);
    index.insert_many(
        vectors
            .iter()
            .enumerate()
            .map(|(i, v)| ([1; 32], EntryId(i as u128), v.clone()))
            .collect(),
    );
    assert_eq!(index.build_graphs(), 1);
    assert_eq!(index.graphs(), 1, "the partition is past exact_scan_max");
    let after = HEAP.live();
    drop(index);
    let per = |bytes: isize| bytes as f64 / ENTRIES as f64;
    (per(before - start), per(after - before))
}

#[test]
fn the_index_holds_no_copy_of_the_vectors() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    assert!(ENTRIES > IndexConfig::default().exact_scan_max);
    // Warm up: the first graph build starts rayon's pool, whose allocations stay.
    bytes_per_entry(8, 8, IndexConfig::default());
    let (_, small) = bytes_per_entry(8, 8, IndexConfig::default());
    let (vector, large) = bytes_per_entry(384, 8, IndexConfig::default());
    // Stored components are half floats.
    let components = ((384 - 8) * 2) as f64;
    eprintln!(
        "index bytes/entry: {small:.0} at 8 dims, {large:.0} at 384 dims; \
         the 384-dim vector {vector:.0}"
    );
    // One copy anywhere in the index would add `components` (752 bytes) per entry.
    assert!(
        (large - small).abs() < components / 4.0,
        "the index grows with the vector's size: {small:.0} bytes/entry at 8 dims, \
         {large:.0} at 384"
    );
    // The vector is two bytes a component (and its handle's counts, and the `Vec` of
    // vectors made here).
    assert!(
        vector < (384 * 2 + 64) as f64,
        "{vector:.0} bytes per vector"
    );
    // And what the index adds is bounded (the graph's links, the slot and the id maps),
    // so a 384-dimension entry's vector and index stay within 3 KB, allocations counted
    // as requested (malloc adds its header and rounding to each).
    assert!(large < 2048.0, "{large:.0} bytes/entry");
    assert!(vector + large < 3072.0, "{:.0} bytes/entry", vector + large);
}

#[test]
fn random_vectors_in_384_dimensions_stay_within_3_kb_and_the_charge() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Warm up: the first graph build starts rayon's pool, whose allocations stay.
    bytes_per_entry(8, 8, IndexConfig::default());
    let mut rows = Vec::new();
    for m in [4, 8, 16, 32] {
        let cfg = IndexConfig {
            hnsw_m: m,
            // What the budget charges without tombstones, at a rebuild ratio of 0.
            rebuild_tombstone_ratio: 0.0,
            ..IndexConfig::default()
        };
        let charge = f64::from(SemanticIndex::new(384, cfg.clone()).charge());
        let (_, shaped) = bytes_per_entry(384, 8, cfg.clone());
        let (vector, random) = bytes_per_entry(384, 384, cfg.clone());
        eprintln!(
            "hnsw_m {m}: index bytes/entry {shaped:.0} at 8 effective dimensions, \
             {random:.0} on random vectors; the vector {vector:.0}; charged {charge:.0}"
        );
        rows.push((m, charge, shaped, vector, random));
    }
    for (m, charge, shaped, vector, random) in rows {
        // The default's entry, vector and index, within 3 KB on the worst case too
        // (allocations counted as requested: malloc adds its header and rounding to each).
        if m == IndexConfig::default().hnsw_m {
            assert!(
                vector + random < 3072.0,
                "{:.0} bytes/entry at hnsw_m {m} on random vectors",
                vector + random
            );
        }
        // What the memory budget charges an indexed entry covers what the index holds on
        // either kind of vector, and not by more than twice the worst.
        assert!(
            random.max(shaped) <= charge && charge <= 2.0 * random.max(shaped),
            "charged {charge:.0} bytes per indexed entry at hnsw_m {m}, held {shaped:.0} \
             (8 effective dimensions) and {random:.0} (random)"
        );
    }
}
