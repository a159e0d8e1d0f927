//! What the semantic index adds to memory per entry, counted exactly by a counting allocator
//! (this test binary's global allocator; one test, so nothing else allocates meanwhile).
//!
//! The vectors are made before counting, as the cache's entries hold their embeddings; the
//! index must hold them without copying, so what it adds per entry does not grow with the
//! vector's size: the same entries at 8 dimensions and padded with zeros to 384 (the same
//! similarities, so the same graph) cost the index the same, within a fraction of one
//! vector's floats.

use reprise_cache::semantic::{IndexConfig, SemanticIndex};
use reprise_cache::testing::{unit_vector, CountingAllocator};
use reprise_cache::{EntryId, Vector};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

const ENTRIES: usize = 3000;

/// `n` unit vectors with 8 random components, padded with zeros to `dim`.
fn unit_vectors(dim: usize, n: usize) -> Vec<Vector> {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    (0..n)
        .map(|_| unit_vector(dim, 8, &mut seed).into())
        .collect()
}

/// Bytes per entry once `ENTRIES` vectors of `dim` components are loaded in one partition
/// (past the exact-scan limit) and its graph is built: (the vectors themselves, what the
/// index adds).
fn bytes_per_entry(dim: usize) -> (f64, f64) {
    let start = HEAP.live();
    let vectors = unit_vectors(dim, ENTRIES);
    let before = HEAP.live();
    let index = SemanticIndex::new(dim, IndexConfig::default());
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
    assert!(ENTRIES > IndexConfig::default().exact_scan_max);
    // Warm up: the first graph build starts rayon's pool, whose allocations stay.
    bytes_per_entry(8);
    let (_, small) = bytes_per_entry(8);
    let (vector, large) = bytes_per_entry(384);
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
    // What the memory budget charges an indexed entry for its slot (without tombstones, at
    // a rebuild ratio of 0) covers what the index holds, and not by more than twice.
    let charge = f64::from(
        SemanticIndex::new(
            384,
            IndexConfig {
                rebuild_tombstone_ratio: 0.0,
                ..IndexConfig::default()
            },
        )
        .charge(),
    );
    assert!(
        large <= charge && charge <= 2.0 * large,
        "charged {charge:.0} bytes per indexed entry, held {large:.0}"
    );
}
