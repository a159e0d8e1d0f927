//! Whether `cache.memory_bytes` bounds what the store holds when tenants have memory shares:
//! each entry and key is then also recorded in its pool's ledger (another cache item), and
//! that accounting must fit in the budget too. Counted exactly by this test binary's counting
//! allocator (one test, so nothing else allocates meanwhile).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use reprise_cache::testing::{assert_heap_within, heap_allowed, CountingAllocator};
use reprise_cache::{now_ms, Entry, EntryId, MemoryShares, Origin, Store};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator::new();

/// The `i`-th answer of `namespace`: `bytes` of text and a short prompt, no embedding.
fn answer(i: u64, namespace: &str, bytes: usize) -> Entry {
    Entry {
        id: EntryId(u128::from(i) + 1),
        namespace: namespace.into(),
        model: "m".into(),
        text: format!("{i:08} {}", "a".repeat(bytes)),
        finish_reason: "stop".into(),
        prompt_tokens: 30,
        completion_tokens: 100,
        prompt: format!("{i:08} question"),
        partition: [0; 32],
        embedding: None,
        embedder: None,
        origin: Origin::Live,
        tags: Vec::new(),
        refusals: Vec::new(),
        created_ms: now_ms(),
        expires_ms: now_ms() + 3_600_000,
        gen_ms: 100,
    }
}

/// The pool of a namespace: its part before the first `/`.
fn pool_of(namespace: &str) -> &str {
    namespace.split('/').next().unwrap_or(namespace)
}

#[tokio::test(flavor = "current_thread")]
async fn memory_shares_keep_entries_keys_and_their_ledgers_within_the_budget() {
    const BUDGET: u64 = 8 * 1024 * 1024;
    // Small answers: the ledger's record of each is a large part of what it costs.
    const TEXT: usize = 300;
    let before = HEAP.live();
    let store = Store::new(
        BUDGET,
        Duration::from_secs(3600),
        Duration::ZERO,
        None,
        None,
        None,
    );
    store.set_memory_shares(
        Some(MemoryShares {
            pool_of,
            pools: HashMap::from([("a".to_string(), BUDGET / 2)]),
            rest: BUDGET / 2,
        }),
        1,
    );
    let one = u64::from(answer(0, "a/x", TEXT).weight()).max(1);
    let total = 4 * BUDGET / one;
    let mut peak = 0isize;
    for i in 0..total {
        // Both pools fill past their shares.
        let ns = if i % 2 == 0 { "a/x" } else { "b/x" };
        let key = *blake3::hash(&i.to_le_bytes()).as_bytes();
        store.insert(Arc::new(answer(i, ns, TEXT)), &[key]).await;
        if i % 64 == 63 {
            store.run_pending_tasks().await;
            peak = peak.max(HEAP.live() - before);
        }
    }
    store.run_pending_tasks().await;
    let held = HEAP.live() - before;
    peak = peak.max(held);
    let allowed = heap_allowed(BUDGET);
    let entries = store.entry_count().max(1);
    eprintln!(
        "{total} inserted, {entries} held; heap held {held} B ({} B/entry), peak {peak} B; allowed {allowed} B",
        held as u64 / entries,
    );
    assert!(
        store.entry_count() < total / 2,
        "the store evicted (it was given four times its budget)"
    );
    for pool in ["a/x", "b/x"] {
        let size = store.pool_size(pool).expect("shares set");
        assert!(
            size <= BUDGET / 2,
            "{pool} holds {size} B of its {} B",
            BUDGET / 2
        );
    }
    assert_heap_within(peak, BUDGET);
}
