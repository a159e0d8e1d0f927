//! The semantic index with synthetic vectors: exact and HNSW paths, partition isolation,
//! tombstones, rebuilds and recall across the exact-scan threshold.

use std::sync::Arc;

use reprise_cache::semantic::{GraphStats, IndexConfig, PartitionKey, SemanticIndex};
use reprise_cache::testing::unit_vector;
use reprise_cache::{EntryId, Vector};

const DIM: usize = 32;

/// A small deterministic generator (xorshift64*), enough for test vectors.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn unit(&mut self) -> Arc<[f32]> {
        let v: Vec<f32> = (0..DIM).map(|_| self.next_f32()).collect();
        normalise(&v)
    }
}

fn normalise(v: &[f32]) -> Arc<[f32]> {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / n).collect()
}

fn key(b: u8) -> PartitionKey {
    [b; 32]
}

/// The similarity of `q` to `v` as the index holds `v` (in half floats).
fn stored(v: &[f32], q: &[f32]) -> f32 {
    Vector::new(v).dot(q)
}

/// Brute-force best id among `items` (skipping `removed`).
fn brute_best(items: &[(EntryId, Arc<[f32]>)], q: &[f32], removed: &[EntryId]) -> EntryId {
    items
        .iter()
        .filter(|(id, _)| !removed.contains(id))
        .max_by(|a, b| stored(&a.1, q).total_cmp(&stored(&b.1, q)))
        .unwrap()
        .0
}

fn small_cfg(exact_scan_max: usize) -> IndexConfig {
    IndexConfig {
        exact_scan_max,
        ..IndexConfig::default()
    }
}

fn fill(
    idx: &SemanticIndex,
    p: PartitionKey,
    n: usize,
    rng: &mut Rng,
) -> Vec<(EntryId, Arc<[f32]>)> {
    (0..n)
        .map(|_| {
            let id = EntryId::random();
            let v = rng.unit();
            idx.insert(p, id, Vector::from(&v));
            (id, v)
        })
        .collect()
}

/// A query near `v`: `v` plus a little noise, renormalised.
fn near(v: &[f32], rng: &mut Rng, noise: f32) -> Arc<[f32]> {
    let w: Vec<f32> = v.iter().map(|x| x + noise * rng.next_f32()).collect();
    normalise(&w)
}

#[test]
fn exact_scan_finds_the_nearest() {
    let idx = SemanticIndex::new(DIM, small_cfg(10_000));
    let mut rng = Rng(1);
    let items = fill(&idx, key(1), 500, &mut rng);
    for (id, v) in items.iter().step_by(25) {
        let q = near(v, &mut rng, 0.05);
        let got = idx.search(&key(1), &q, 3);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].id, *id);
        assert_eq!(got[0].id, brute_best(&items, &q, &[]));
        assert!(got[0].similarity >= got[1].similarity && got[1].similarity >= got[2].similarity);
    }
}

#[test]
fn hnsw_finds_the_nearest() {
    let idx = SemanticIndex::new(DIM, small_cfg(100));
    let mut rng = Rng(2);
    let items = fill(&idx, key(2), 1500, &mut rng);
    // Inserts leave the graph to maintenance.
    assert_eq!(idx.maintain().rebuilt, 1);
    assert_eq!(idx.graphs(), 1);
    let mut hits = 0;
    let probes: Vec<_> = items.iter().step_by(15).collect();
    for (id, v) in &probes {
        let q = near(v, &mut rng, 0.05);
        let got = idx.search(&key(2), &q, 5);
        assert_eq!(got.len(), 5);
        if got[0].id == *id {
            hits += 1;
        }
    }
    assert!(hits * 100 >= probes.len() * 95, "{hits}/{}", probes.len());
    assert_eq!(
        idx.graph_stats().searches as usize,
        probes.len(),
        "the graph answered"
    );
}

#[test]
fn partitions_never_leak() {
    let idx = SemanticIndex::new(DIM, small_cfg(50));
    let mut rng = Rng(3);
    // One partition on the exact path, one on the graph path.
    let a = fill(&idx, key(10), 30, &mut rng);
    let b = fill(&idx, key(11), 300, &mut rng);
    idx.maintain();
    assert_eq!(idx.graphs(), 1);
    assert_eq!(idx.partitions(), 2);
    assert_eq!(idx.len(), 330);
    for (_, v) in a.iter().take(10) {
        for c in idx.search(&key(11), v, 10) {
            assert!(b.iter().any(|(id, _)| *id == c.id));
        }
    }
    for (_, v) in b.iter().take(10) {
        for c in idx.search(&key(10), v, 10) {
            assert!(a.iter().any(|(id, _)| *id == c.id));
        }
    }
    assert!(idx.search(&key(12), &a[0].1, 5).is_empty());
}

#[test]
fn removed_ids_never_come_back() {
    for exact_scan_max in [10_000, 50] {
        let idx = SemanticIndex::new(DIM, small_cfg(exact_scan_max));
        let mut rng = Rng(4);
        let items = fill(&idx, key(4), 400, &mut rng);
        idx.maintain();
        assert_eq!(idx.graphs(), usize::from(exact_scan_max < 400));
        let removed: Vec<EntryId> = items.iter().step_by(3).map(|(id, _)| *id).collect();
        for id in &removed {
            assert!(idx.remove(*id));
            assert!(!idx.remove(*id), "second removal of {id}");
        }
        assert_eq!(idx.len(), 400 - removed.len());
        for (id, v) in items.iter().step_by(3) {
            let got = idx.search(&key(4), v, 10);
            assert_eq!(got.len(), 10);
            assert!(
                got.iter().all(|c| !removed.contains(&c.id)),
                "{id} came back"
            );
        }
    }
}

#[test]
fn rebuild_drops_tombstones_and_keeps_the_live() {
    for exact_scan_max in [10_000, 100] {
        let idx = SemanticIndex::new(DIM, small_cfg(exact_scan_max));
        let mut rng = Rng(5);
        let items = fill(&idx, key(5), 600, &mut rng);
        let removed: Vec<EntryId> = items.iter().step_by(2).map(|(id, _)| *id).collect();
        for id in &removed {
            idx.remove(*id);
        }
        let report = idx.maintain();
        assert_eq!(report.rebuilt, 1);
        assert_eq!(report.tombstones_dropped, removed.len());
        // Nothing left to do a second time.
        assert_eq!(idx.maintain().rebuilt, 0);
        assert_eq!(idx.len(), 300);
        let mut hits = 0;
        for (id, v) in items.iter().skip(1).step_by(2) {
            let got = idx.search(&key(5), v, 3);
            assert!(got.iter().all(|c| !removed.contains(&c.id)));
            if got[0].id == *id {
                hits += 1;
            }
        }
        assert!(hits >= 295, "{hits}/300 live entries found themselves");
        // Removing after a rebuild still works.
        assert!(idx.remove(items[1].0));
        assert!(idx
            .search(&key(5), &items[1].1, 3)
            .iter()
            .all(|c| c.id != items[1].0));
    }
}

#[test]
fn maintain_drops_emptied_partitions() {
    let idx = SemanticIndex::new(DIM, IndexConfig::default());
    let mut rng = Rng(6);
    let items = fill(&idx, key(6), 5, &mut rng);
    for (id, _) in &items {
        idx.remove(*id);
    }
    assert_eq!(idx.partitions(), 1);
    assert_eq!(idx.maintain().emptied, 1);
    assert_eq!(idx.partitions(), 0);
    assert!(idx.is_empty());
}

#[test]
fn crossing_the_threshold_keeps_recall() {
    // Past the exact-scan limit (no insert builds a graph): exact scans serve until
    // maintenance builds the graph, which then grows point by point.
    let limit = 256;
    let idx = SemanticIndex::new(DIM, small_cfg(limit));
    let mut rng = Rng(7);
    let mut items = fill(&idx, key(7), 600, &mut rng);
    assert_eq!(idx.graph_points(&key(7)), None, "no graph inside an insert");
    assert_eq!(idx.maintain().rebuilt, 1);
    assert_eq!(idx.graph_points(&key(7)), Some(600));
    items.extend(fill(&idx, key(7), 400, &mut rng));
    let stats = idx.graph_stats();
    assert_eq!(stats.builds, 1, "{stats:?}");
    assert_eq!(stats.inserts, 400, "{stats:?}");
    assert_eq!(idx.graph_points(&key(7)), Some(1000));
    let queries: Vec<Arc<[f32]>> = (0..200).map(|_| rng.unit()).collect();
    let mut agree = 0;
    for q in &queries {
        let got = idx.search(&key(7), q, 1);
        if got[0].id == brute_best(&items, q, &[]) {
            agree += 1;
        }
    }
    assert_eq!(
        idx.graph_stats().searches,
        200,
        "every search went through the graph"
    );
    assert!(
        agree as f32 / queries.len() as f32 >= 0.95,
        "recall {agree}/200"
    );
}

#[test]
fn concurrent_inserts_and_searches() {
    let idx = Arc::new(SemanticIndex::new(DIM, small_cfg(200)));
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let idx = Arc::clone(&idx);
            std::thread::spawn(move || {
                let mut rng = Rng(100 + t as u64);
                let items = fill(&idx, key(20 + t % 2), 300, &mut rng);
                for (_, v) in items.iter().step_by(10) {
                    assert!(!idx.search(&key(20 + t % 2), v, 3).is_empty());
                }
                for (id, _) in items.iter().step_by(4) {
                    assert!(idx.remove(*id));
                }
                idx.maintain();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(idx.len(), 4 * (300 - 75));
}

/// `n` distinct unit vectors of `dim` components (xorshift), for bulk loads.
fn vectors(dim: usize, n: usize, mut seed: u64) -> Vec<Arc<[f32]>> {
    (0..n)
        .map(|_| unit_vector(dim, dim, &mut seed).into())
        .collect()
}

#[test]
fn a_bulk_load_is_searchable_at_once_and_its_graph_built_after_finds_what_exact_search_finds() {
    let dim = 8;
    let idx = SemanticIndex::new(dim, small_cfg(256));
    let part = [9u8; 32];
    let vs = vectors(dim, 2000, 0x2545_f491_4f6c_dd1d);
    idx.insert_many(
        vs.iter()
            .enumerate()
            .map(|(i, v)| (part, EntryId(i as u128), Vector::from(v)))
            .collect(),
    );
    assert_eq!(idx.len(), 2000);
    // Placed, searchable, and no graph built inside the load.
    assert_eq!(idx.graphs(), 0);
    let queries = vectors(dim, 100, 0x9E37_79B9_7F4A_7C15);
    let exact: Vec<Vec<EntryId>> = queries
        .iter()
        .map(|q| idx.search(&part, q, 5).iter().map(|c| c.id).collect())
        .collect();
    assert!(exact.iter().all(|ids| ids.len() == 5));
    // The exact scan really is exact.
    for (q, ids) in queries.iter().zip(&exact) {
        let all: Vec<(EntryId, Arc<[f32]>)> = vs
            .iter()
            .enumerate()
            .map(|(i, v)| (EntryId(i as u128), v.clone()))
            .collect();
        assert_eq!(ids[0], brute_best(&all, q, &[]));
    }
    assert_eq!(
        idx.graph_stats(),
        GraphStats::default(),
        "no graph work in the load"
    );

    assert_eq!(idx.build_graphs(), 1);
    assert_eq!(idx.graphs(), 1);
    // One graph over all 2,000 in one pass, not grown point by point.
    let built = idx.graph_stats();
    assert_eq!((built.builds, built.inserts), (1, 0), "{built:?}");
    assert_eq!(idx.graph_points(&part), Some(2000));
    assert_eq!(idx.build_graphs(), 0, "nothing left to build");
    // The graph finds the same five, in the same order, as the exact scan did.
    for (q, ids) in queries.iter().zip(&exact) {
        let got: Vec<EntryId> = idx.search(&part, q, 5).iter().map(|c| c.id).collect();
        assert_eq!(&got, ids);
    }
}

#[test]
fn inserts_into_a_partition_awaiting_its_graph_do_not_build_it() {
    let idx = SemanticIndex::new(DIM, small_cfg(64));
    let part = key(10);
    let vs = vectors(DIM, 300, 77);
    // Past four times the limit: a point insert into a graphless partition this big would
    // build the graph itself, holding the partition's lock throughout.
    idx.insert_many(
        vs.iter()
            .enumerate()
            .map(|(i, v)| (part, EntryId(i as u128), Vector::from(v)))
            .collect(),
    );
    let mut rng = Rng(5);
    fill(&idx, part, 3, &mut rng);
    assert_eq!(idx.graphs(), 0, "left to the background build");
    assert_eq!(idx.maintain().rebuilt, 1);
    assert_eq!(idx.graphs(), 1);
    // Later inserts go into the graph.
    let late = fill(&idx, part, 5, &mut rng);
    for (id, v) in &late {
        assert_eq!(idx.search(&part, v, 1)[0].id, *id);
    }
}

#[test]
fn the_index_and_its_graph_share_the_callers_vectors() {
    let idx = SemanticIndex::new(DIM, small_cfg(64));
    let part = key(11);
    let vs: Vec<Vector> = vectors(DIM, 200, 99).iter().map(Vector::from).collect();
    idx.insert_many(
        vs.iter()
            .enumerate()
            .map(|(i, v)| (part, EntryId(i as u128), v.clone()))
            .collect(),
    );
    // Held by the caller and by the partition's slot: no copy.
    for (i, v) in vs.iter().enumerate() {
        assert!(Vector::ptr_eq(&idx.vector(EntryId(i as u128)).unwrap(), v));
        assert_eq!(v.handles(), 2);
    }
    assert_eq!(idx.build_graphs(), 1);
    // The graph's points hold the same vectors (a third reference, not a third copy).
    for (i, v) in vs.iter().enumerate() {
        assert!(Vector::ptr_eq(&idx.vector(EntryId(i as u128)).unwrap(), v));
        assert_eq!(v.handles(), 3);
    }
    // So does a point inserted into the graph afterwards.
    let late = Vector::from(&vectors(DIM, 1, 1234)[0]);
    idx.insert(part, EntryId(9999), late.clone());
    assert!(Vector::ptr_eq(&idx.vector(EntryId(9999)).unwrap(), &late));
    assert_eq!(late.handles(), 3);
    // Removing the entries releases them.
    for i in 0..200u128 {
        idx.remove(EntryId(i));
    }
    idx.maintain();
    assert!(vs.iter().all(|v| v.handles() == 1));
}

#[test]
fn maintenance_builds_the_graph_of_a_partition_that_outgrew_exact_scans() {
    let idx = SemanticIndex::new(DIM, small_cfg(100));
    let mut rng = Rng(77);
    let items = fill(&idx, key(42), 150, &mut rng);
    // Past the limit but not far past it: no graph was built inside an insert.
    assert_eq!(idx.graphs(), 0);
    let report = idx.maintain();
    assert_eq!(report.rebuilt, 1, "{report:?}");
    // A second pass has nothing to do, and the graph answers.
    assert_eq!(idx.graphs(), 1);
    assert_eq!(idx.maintain().rebuilt, 0);
    assert_eq!(idx.graph_points(&key(42)), Some(150));
    let (id, v) = &items[17];
    assert_eq!(idx.search(&key(42), v, 1)[0].id, *id);
    assert_eq!(idx.graph_stats().searches, 1, "the graph answered");
}

/// A vector is indexed only when memory holds its entry: an answer its pool's share refuses
/// (larger than the whole share) leaves nothing in the index, where it would sit outside
/// every budget; one the share takes is indexed.
#[tokio::test]
async fn an_entry_its_share_refuses_leaves_no_vector_behind() {
    use reprise_cache::{now_ms, Entry, MemoryShares, Origin, Store};
    use std::collections::HashMap;
    use std::time::Duration;
    fn whole(namespace: &str) -> &str {
        namespace
    }

    let index = Arc::new(SemanticIndex::new(DIM, IndexConfig::default()));
    let store = Store::new(
        1 << 20,
        Duration::from_secs(3600),
        Duration::ZERO,
        None,
        Some(index),
        None,
    );
    store.set_memory_shares(
        Some(MemoryShares {
            pool_of: whole,
            pools: HashMap::from([("small".to_string(), 4096)]),
            rest: 1 << 19,
        }),
        1,
    );
    let mut rng = Rng(7);
    let answer = |namespace: &str, bytes: usize, v: Arc<[f32]>| Entry {
        id: EntryId::random(),
        namespace: namespace.into(),
        model: "m".into(),
        text: "a".repeat(bytes),
        finish_reason: "stop".into(),
        prompt_tokens: 1,
        completion_tokens: 1,
        prompt: "question".into(),
        partition: key(1),
        embedding: Some(Vector::from(&v)),
        embedder: None,
        origin: Origin::Live,
        tags: Vec::new(),
        refusals: Vec::new(),
        created_ms: now_ms(),
        expires_ms: now_ms() + 3_600_000,
        gen_ms: 1,
    };
    let big = Arc::new(answer("small", 16 * 1024, rng.unit()));
    store.insert(big.clone(), &[[1; 32]]).await;
    store.run_pending_tasks().await;
    assert!(store.get(big.id).await.is_none(), "refused by its share");
    assert_eq!(store.indexed(), 0, "and not indexed");
    let fits = Arc::new(answer("other", 100, rng.unit()));
    store.insert(fits.clone(), &[[2; 32]]).await;
    assert!(store.get(fits.id).await.is_some());
    assert_eq!(store.indexed(), 1);
}

/// `Store::holds` tells whether an entry is held without reading it: an entry only asked
/// about is evicted as the tier fills, one read all along is kept.
#[tokio::test]
async fn asking_whether_an_entry_is_held_does_not_keep_it() {
    use reprise_cache::{Origin, Store};
    use std::time::Duration;

    let answer = |i: usize| reprise_cache::testing::big_answer(i, Origin::Prefetch);
    let store = Store::new(
        1 << 20,
        Duration::from_secs(3600),
        Duration::ZERO,
        None,
        None,
        None,
    );
    let (asked, read) = (answer(0), answer(1));
    store.insert(asked.clone(), &[]).await;
    store.insert(read.clone(), &[]).await;
    // Four times the budget of other answers, each read twice (as hits would); both are
    // looked at before each one.
    for i in 2..500 {
        assert!(store.holds(read.id));
        store.holds(asked.id);
        store.get(read.id).await;
        let other = answer(i);
        store.insert(other.clone(), &[]).await;
        store.get(other.id).await;
        store.get(other.id).await;
        store.run_pending_tasks().await;
    }
    assert!(!store.holds(asked.id), "evicted: asking is not reading");
    assert!(store.holds(read.id), "kept: read all along");
}

/// A graph search stops once its nearest candidate is farther than its farthest result, with
/// tombstones in the partition too: it computes well under half the partition's distances
/// (about a third on these 32-dim random vectors) and finds what an exact scan of the live
/// entries finds. (hnsw_rs's filtered search walks on until no candidate is left: about two
/// thirds here, and a larger share the larger the partition.)
#[test]
fn a_graph_search_with_tombstones_visits_a_small_share_of_the_partition() {
    use reprise_cache::semantic::graph_distances_on_this_thread;
    const N: usize = 4000;
    let idx = SemanticIndex::new(DIM, small_cfg(50));
    let mut rng = Rng(11);
    let items = fill(&idx, key(11), N, &mut rng);
    assert_eq!(idx.maintain().rebuilt, 1);
    // A fifth removed: under the rebuild ratio, so the graph keeps their slots.
    let removed: Vec<EntryId> = items.iter().step_by(5).map(|(id, _)| *id).collect();
    for id in &removed {
        assert!(idx.remove(*id));
    }
    assert_eq!(idx.maintain().rebuilt, 0, "tombstones kept");
    let (mut agree, mut queries) = (0, 0);
    let before = graph_distances_on_this_thread();
    for (_, v) in items.iter().take(200) {
        let q = near(v, &mut rng, 0.1);
        let got = idx.search(&key(11), &q, 5);
        assert_eq!(got.len(), 5);
        assert!(got.iter().all(|c| !removed.contains(&c.id)));
        agree += usize::from(got[0].id == brute_best(&items, &q, &removed));
        queries += 1;
    }
    let per_search = (graph_distances_on_this_thread() - before) / queries;
    let stats = idx.graph_stats();
    assert_eq!(stats.searches, queries);
    assert!(
        per_search < N as u64 / 2,
        "{per_search} distances a search in a partition of {N} ({stats:?})"
    );
    assert!(
        agree >= 190,
        "{agree} of {queries} found the nearest live entry"
    );
}

/// When the nearest slots are all tombstones, the unfiltered search comes up short of live
/// results and the search runs again with the filter: the live nearest are still found.
#[test]
fn a_search_whose_nearest_are_all_removed_falls_back_to_the_filtered_one() {
    let idx = SemanticIndex::new(DIM, small_cfg(50));
    let mut rng = Rng(12);
    let items = fill(&idx, key(12), 1000, &mut rng);
    assert_eq!(idx.maintain().rebuilt, 1);
    let q = items[0].1.clone();
    let mut by_similarity: Vec<(f32, EntryId)> =
        items.iter().map(|(id, v)| (stored(v, &q), *id)).collect();
    by_similarity.sort_by(|a, b| b.0.total_cmp(&a.0));
    let removed: Vec<EntryId> = by_similarity.iter().take(30).map(|(_, id)| *id).collect();
    for id in &removed {
        assert!(idx.remove(*id));
    }
    let got = idx.search(&key(12), &q, 5);
    assert_eq!(
        idx.graph_stats().filtered,
        1,
        "searched again with the filter"
    );
    assert_eq!(got.len(), 5);
    assert!(got.iter().all(|c| !removed.contains(&c.id)));
    assert_eq!(got[0].id, brute_best(&items, &q, &removed));
}
