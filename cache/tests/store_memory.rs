//! Whether `cache.memory_bytes` bounds what the store really holds: the heap a store of
//! entries, exact keys and the semantic index takes, counted exactly by a counting allocator
//! (this test binary's global allocator; one test, so nothing else allocates meanwhile),
//! against the budget it was given.
//!
//! The store is filled with several times its budget of distinct answers, each with its key
//! and its embedding in the index, so that it evicts all along (and the index carries
//! tombstones of what was evicted, up to its rebuild ratio); the heap it then holds must stay
//! within the entries' budget plus the keys' (an eighth of it), within a small slack for the
//! caches' fixed tables.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use reprise_cache::semantic::{IndexConfig, SemanticIndex};
use reprise_cache::testing::{assert_heap_within, heap_allowed, unit_vector, CountingAllocator};
use reprise_cache::{now_ms, Entry, EntryId, Origin, Store, Vector};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

/// The embedder's dimension (all-MiniLM-L6-v2).
const DIM: usize = 384;

/// A unit vector with 8 pseudo-random components (from `seed`), zero elsewhere.
fn embedding(seed: u64) -> Vector {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    unit_vector(DIM, 8, &mut s).into()
}

/// The `i`-th answer: `bytes` of text, a prompt of a quarter of that, an embedding, in one
/// of four partitions (so every partition passes the exact-scan limit and gets a graph).
fn entry(i: u64, bytes: usize) -> Entry {
    let mut partition = [0u8; 32];
    partition[0] = 1 + (i % 4) as u8;
    Entry {
        id: EntryId(u128::from(i) + 1),
        namespace: "ns".into(),
        model: "m".into(),
        text: format!("{i:08} {}", "a".repeat(bytes)),
        finish_reason: "stop".into(),
        prompt_tokens: 30,
        completion_tokens: 200,
        prompt: format!("{i:08} {}", "q".repeat(bytes / 4)),
        partition,
        embedding: Some(embedding(i)),
        embedder: None,
        origin: Origin::Live,
        tags: Vec::new(),
        refusals: Vec::new(),
        created_ms: now_ms(),
        expires_ms: now_ms() + 3_600_000,
        gen_ms: 100,
    }
}

fn key(i: u64) -> [u8; 32] {
    *blake3::hash(&i.to_le_bytes()).as_bytes()
}

#[tokio::test(flavor = "current_thread")]
async fn the_memory_budget_bounds_entries_keys_and_index_together() {
    const BUDGET: u64 = 8 * 1024 * 1024;
    const TEXT: usize = 700;
    let cfg = IndexConfig {
        // Small, so the partitions build graphs (and rebuild them after evictions) within a
        // test's time, as big ones do in service.
        exact_scan_max: 256,
        ef_construction: 32,
        ..IndexConfig::default()
    };
    let before = HEAP.live();
    let index = Arc::new(SemanticIndex::new(DIM, cfg));
    let store = Store::new(
        BUDGET,
        Duration::from_secs(3600),
        Duration::ZERO,
        None,
        Some(index.clone()),
        None,
    );
    // What one entry weighs, to know how many fill the budget.
    let one = u64::from(entry(0, TEXT).weight()).max(1);
    let total = 4 * BUDGET / one;
    let mut peak = 0isize;
    let mut rebuilds = 0;
    for i in 0..total {
        store.insert(Arc::new(entry(i, TEXT)), &[key(i)]).await;
        if i % 64 == 63 {
            store.run_pending_tasks().await;
            // As the service's maintenance task does: a rebuild as soon as a removal leaves
            // a partition worn past the ratio the budget charges for.
            if index.worn().now_or_never().is_some() {
                rebuilds += store.maintain().map_or(0, |r| r.rebuilt);
            }
            peak = peak.max(HEAP.live() - before);
        }
    }
    store.run_pending_tasks().await;
    let held = HEAP.live() - before;
    peak = peak.max(held);
    let allowed = heap_allowed(BUDGET);
    let entries = store.entry_count().max(1);
    eprintln!(
        "{total} inserted, {entries} held, {rebuilds} rebuilds; weighted {} B ({} B/entry); heap held {held} B ({} B/entry), peak {peak} B; allowed {allowed} B; index {} vectors",
        store.weighted_size(),
        store.weighted_size() / entries,
        held as u64 / entries,
        index.len(),
    );
    assert!(
        store.entry_count() < total / 2,
        "the store evicted (it was given four times its budget)"
    );
    assert!(
        index.graphs() > 0 && rebuilds > 0,
        "the partitions built graphs and rebuilt them without tombstones, as big ones do in \
         service ({rebuilds} rebuilds)"
    );
    assert_heap_within(peak, BUDGET);
}
