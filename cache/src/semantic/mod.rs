//! The semantic index: finds cached entries whose prompt embedding is close to a query's.
//!
//! Entries live in partitions keyed by a digest of everything that must match exactly
//! (namespace, model, output-affecting parameters, conversation context), so a search never
//! crosses into another partition. Small partitions are scanned exactly over their vectors;
//! once a partition grows past [`IndexConfig::exact_scan_max`] it also gets an HNSW graph
//! (hnsw_rs) and is searched approximately.
//!
//! Each vector is held once: the index keeps the caller's [`Vector`] (the entry's own
//! embedding, in half floats), and the graph's points hold that same handle, not a copy of
//! the components, so what the index adds per entry is its slot and the graph's links.
//! Queries are full-precision `f32`; the graph walks with a half-float copy of the query, and
//! candidates are scored with the full-precision one.
//!
//! A bulk load ([`SemanticIndex::insert_many`]) places the vectors and returns: big partitions
//! are searched by exact scans until [`SemanticIndex::maintain`] (or
//! [`SemanticIndex::build_graphs`]) has built their graphs, off the request path, so a replica
//! rebuilding from Redis answers semantic lookups without waiting for graph construction.
//!
//! Removal is a tombstone: the id is never returned again, and [`SemanticIndex::maintain`]
//! rebuilds partitions whose tombstones pass [`IndexConfig::rebuild_tombstone_ratio`].
//!
//! Vectors are expected L2-normalised, so similarity is a dot product (= cosine).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hnsw_rs::anndists::dist::Distance;
use hnsw_rs::hnsw::Hnsw;
use parking_lot::{Mutex, RwLock};
use serde::Deserialize;

use crate::vector::Vector;
use crate::EntryId;

mod recall;

pub use recall::MAX_PENDING as RECALL_MAX_PENDING;
use recall::{Checked, RecallCounters, Sample, Samples};

/// A digest of everything that must match exactly for two prompts to share an answer.
pub type PartitionKey = [u8; 32];

/// An entry id and its vector.
type IdVector = (EntryId, Vector);

/// One vector to index: its partition, entry id and vector.
pub type IndexItem = (PartitionKey, EntryId, Vector);

/// Tuning of the semantic index.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Partitions with up to this many vectors are scanned exactly; bigger ones get an HNSW
    /// graph. An exact scan of 2048 × 384 floats takes well under a millisecond.
    pub exact_scan_max: usize,
    /// HNSW: links per node (hnsw_rs `max_nb_connection`, the "M" of the paper).
    pub hnsw_m: usize,
    /// HNSW: candidate list size while inserting (higher = better graph, slower inserts).
    pub ef_construction: usize,
    /// HNSW: candidate list size while searching (higher = better recall, slower search).
    pub ef_search: usize,
    /// A partition is rebuilt by [`SemanticIndex::maintain`] once this fraction of its
    /// slots are tombstones.
    pub rebuild_tombstone_ratio: f32,
    /// One graph search in this many is checked against an exact scan by maintenance (its
    /// recall measured in service); 0: none.
    pub recall_check_every: u32,
    /// A partition whose checked searches find the nearest vector less often than this
    /// searches wider from then on (its `ef_search` doubles, up to `ef_search_max`).
    pub recall_target: f64,
    /// The widest search a partition is widened to.
    pub ef_search_max: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            exact_scan_max: 2048,
            hnsw_m: 16,
            ef_construction: 200,
            ef_search: 64,
            rebuild_tombstone_ratio: 0.3,
            recall_check_every: 256,
            recall_target: 0.99,
            ef_search_max: 512,
        }
    }
}

/// One search result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The entry.
    pub id: EntryId,
    /// Cosine similarity to the query (dot product of normalised vectors), at most about 1.
    pub similarity: f32,
}

/// Partitioned nearest-neighbour index over entry embeddings. All methods take `&self`.
pub struct SemanticIndex {
    dim: usize,
    cfg: IndexConfig,
    // Lock order: `partitions`, then a partition's own lock; `location` is never held with
    // another lock. The maps are held only for lookups and small updates, never while
    // scanning or building a graph.
    partitions: RwLock<HashMap<PartitionKey, Arc<Partition>>>,
    /// Which partition each live id is in, so `remove` needs only the id.
    location: RwLock<HashMap<EntryId, PartitionKey>>,
    /// The fingerprint of the embedder whose vectors it holds, when known.
    embedder: Option<[u8; 32]>,
    /// One maintenance pass at a time: a rebuild snapshots a partition, builds without locks
    /// and swaps in; two overlapping rebuilds of one partition would replay against a
    /// structure the other one already replaced.
    maintaining: Mutex<()>,
    /// What the HNSW side did, for diagnostics and tests.
    graph: GraphCounters,
    /// Told when a removal leaves a partition worn past the rebuild ratio (tombstones hold
    /// memory), or an insert takes one past exact scans (its searches scan every vector), so
    /// maintenance need not wait for its next period.
    worn: tokio::sync::Notify,
    /// Graph searches kept for a check of their recall.
    samples: Samples,
    recall: RecallCounters,
    /// The last partition epoch handed out (see [`recall::Width::epoch`]).
    epochs: AtomicU64,
}

/// What the index holds per slot besides the vector and the graph's links: the slot's id,
/// vector handle and flag, the id maps (hash tables up to half empty after growing) and the
/// graph's point with its neighbour lists. With [`SLOT_BYTES_PER_LINK`] it covers what a
/// counting allocator measures in one graph of 3,000 vectors built at once
/// (`tests/index_memory.rs`, which keeps the charge above it and within twice it): at
/// `hnsw_m` 4, 8, 16 and 32, 604–731 bytes on vectors of 8 effective dimensions and 610,
/// 849, 1,275 and 1,749 on random 384-dimensional ones (the graph's worst case, every
/// neighbour list near full), and the small graphs of `tests/store_memory.rs`, grown one
/// insert at a time and rebuilt as they churn (vectors grown by doubling, hnsw_rs's minimum
/// table sizes), within the budget.
const SLOT_BASE_BYTES: u32 = 1_000;
/// Added per unit of `hnsw_m` to [`SLOT_BASE_BYTES`]: a link is 16 bytes (hnsw_rs's point
/// handle and distance), up to `2 × hnsw_m` of them on the bottom layer, in lists that grow
/// by doubling.
const SLOT_BYTES_PER_LINK: u32 = 40;
/// Slots a recall check scans under one read of its partition (about 0.4 ms of dot
/// products at 384 dimensions; the default `exact_scan_max`'s size).
const RECALL_SCAN_CHUNK: usize = 2_048;

/// Counts of the index's HNSW work since it was created ([`SemanticIndex::graph_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs built over a whole partition in one pass (by `build_graphs` after a bulk load,
    /// or by maintenance).
    pub builds: u64,
    /// Vectors inserted into a graph that already existed.
    pub inserts: u64,
    /// Searches answered by a graph (the rest were exact scans).
    pub searches: u64,
    /// Graph searches run a second time with hnsw_rs's filter of tombstones, the first
    /// (without it) having come up short of live results.
    pub filtered: u64,
    /// Graph searches checked against an exact scan by maintenance.
    pub recall_checks: u64,
    /// Of those, the ones where the graph missed a closer live vector.
    pub recall_misses: u64,
    /// Times a partition's searches were widened for want of recall.
    pub widened: u64,
}

#[derive(Default)]
struct GraphCounters {
    builds: AtomicU64,
    inserts: AtomicU64,
    searches: AtomicU64,
    filtered: AtomicU64,
}

impl GraphCounters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts what pushing `n` vectors into a partition did: inserts into a graph it had, or
    /// the build of one it got.
    fn pushed(&self, had_graph: bool, has_graph: bool, n: usize) {
        if had_graph {
            GraphCounters::add(&self.inserts, n as u64);
        } else if has_graph {
            GraphCounters::add(&self.builds, 1);
        }
    }
}

impl std::fmt::Debug for SemanticIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SemanticIndex")
            .field("dim", &self.dim)
            .field("len", &self.len())
            .field("partitions", &self.partitions())
            .finish()
    }
}

/// What [`SemanticIndex::maintain`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaintainReport {
    /// Partitions rebuilt without their tombstones.
    pub rebuilt: usize,
    /// Tombstones dropped by those rebuilds.
    pub tombstones_dropped: usize,
    /// Partitions dropped because nothing live was left in them.
    pub emptied: usize,
    /// Graph searches checked against an exact scan.
    pub recall_checked: usize,
    /// Of those, the ones whose graph missed a closer live vector.
    pub recall_missed: usize,
    /// Partitions whose searches were widened.
    pub widened: usize,
}

impl SemanticIndex {
    /// An empty index for vectors of `dim` components.
    pub fn new(dim: usize, cfg: IndexConfig) -> Self {
        SemanticIndex {
            dim,
            cfg,
            partitions: RwLock::new(HashMap::new()),
            location: RwLock::new(HashMap::new()),
            maintaining: Mutex::new(()),
            graph: GraphCounters::default(),
            worn: tokio::sync::Notify::new(),
            embedder: None,
            samples: Samples::default(),
            recall: RecallCounters::default(),
            epochs: AtomicU64::new(0),
        }
    }

    /// An epoch no partition of this index had before: a new partition's, or a rebuilt
    /// one's (its slots renumbered).
    fn next_epoch(&self) -> u64 {
        self.epochs.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Bytes the index holds for one entry's vector, besides the vector itself (which the
    /// entry holds and the index shares): its slot and graph point, and its share of the
    /// tombstones. A removed entry's slot (and its vector, held by the graph) stays until its
    /// partition is rebuilt, which maintenance does once tombstones pass
    /// `rebuild_tombstone_ratio` `r` of the slots; so each live entry carries `r / (1 - r)`
    /// of a dead slot and vector. Charged to the entry in the memory budget, so one budget
    /// bounds both (an entry in a small partition, scanned without a graph, costs less than
    /// this: the budget errs on the safe side).
    pub fn charge(&self) -> u32 {
        let r = f64::from(self.cfg.rebuild_tombstone_ratio.clamp(0.0, 0.9));
        let links = u32::try_from(self.cfg.hnsw_m.min(256)).unwrap_or(256);
        let slot = f64::from(SLOT_BASE_BYTES + SLOT_BYTES_PER_LINK * links);
        let vector = Vector::bytes_for(self.dim) as f64;
        let bytes = slot / (1.0 - r) + vector * r / (1.0 - r);
        bytes.ceil().min(f64::from(u32::MAX)) as u32
    }

    /// Waits until some partition is due for a rebuild (a removal left it worn, or an insert
    /// took it past exact scans; a wake-up left from before the call counts): maintenance
    /// runs then as well as on its period.
    pub async fn worn(&self) {
        self.worn.notified().await;
    }

    /// Number of components the index expects.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The index of `embedder`'s vectors (its fingerprint): an entry whose vector another
    /// embedder made is not indexed (see [`SemanticIndex::takes`]).
    pub fn for_embedder(mut self, embedder: [u8; 32]) -> Self {
        self.embedder = Some(embedder);
        self
    }

    /// Whether a vector made by `embedder` belongs here: vectors of different embedders are
    /// not comparable. One of no known embedder (stored before it was recorded), or any
    /// vector in an index of no known embedder, is taken.
    pub fn takes(&self, embedder: Option<&[u8; 32]>) -> bool {
        match (embedder, &self.embedder) {
            (Some(made), Some(ours)) => made == ours,
            _ => true,
        }
    }

    /// Adds (or replaces) `id` in `partition`.
    ///
    /// Panics if `vector` does not have [`SemanticIndex::dim`] components: that is a bug in
    /// the caller, not a runtime condition.
    pub fn insert(&self, partition: PartitionKey, id: EntryId, vector: Vector) {
        assert_eq!(vector.len(), self.dim, "vector dimension mismatch");
        let previous = self.location.write().insert(id, partition);
        if let Some(old) = previous {
            // Re-inserting an id replaces its vector (and maybe its partition).
            if let Some(p) = self.partition(&old) {
                p.inner.write().tombstone(id);
            }
        }
        let p = self.push_into(partition, |this, inner| this.push_one(inner, id, vector));
        self.settle(&partition, &p, &[id]);
    }

    /// After a push into `p`: a `remove` of one of `ids` that ran between the insert's
    /// `location` write and its push found no slot to tombstone, and the push then added a
    /// live slot nothing leads to (never removable, searched forever). Such slots die here:
    /// an id whose `location` is no longer this partition is tombstoned in it.
    fn settle(&self, partition: &PartitionKey, p: &Partition, ids: &[EntryId]) {
        let stray: Vec<EntryId> = {
            let location = self.location.read();
            ids.iter()
                .filter(|id| location.get(id) != Some(partition))
                .copied()
                .collect()
        };
        if stray.is_empty() {
            return;
        }
        let mut inner = p.inner.write();
        for id in stray {
            inner.tombstone(id);
        }
    }

    /// One vector into a partition, counted.
    fn push_one(&self, inner: &mut PartitionInner, id: EntryId, vector: Vector) {
        let had = inner.graph.is_some();
        if inner.push(id, vector, &self.cfg) {
            self.worn.notify_one();
        }
        self.graph.pushed(had, inner.graph.is_some(), 1);
    }

    /// Many vectors into a partition, counted.
    fn push_some(&self, inner: &mut PartitionInner, items: Vec<IdVector>) {
        let (had, n) = (inner.graph.is_some(), items.len());
        inner.push_many(items, &self.cfg);
        self.graph.pushed(had, inner.graph.is_some(), n);
    }

    /// What the HNSW side did since the index was created.
    pub fn graph_stats(&self) -> GraphStats {
        let g = &self.graph;
        GraphStats {
            builds: g.builds.load(Ordering::Relaxed),
            inserts: g.inserts.load(Ordering::Relaxed),
            searches: g.searches.load(Ordering::Relaxed),
            filtered: g.filtered.load(Ordering::Relaxed),
            recall_checks: self.recall.checked.load(Ordering::Relaxed),
            recall_misses: self.recall.missed.load(Ordering::Relaxed),
            widened: self.recall.widened.load(Ordering::Relaxed),
        }
    }

    /// Points in `partition`'s HNSW graph (dead ones included until a rebuild); `None` when
    /// the partition has no graph (it is scanned exactly) or does not exist.
    pub fn graph_points(&self, partition: &PartitionKey) -> Option<usize> {
        let p = self.partition(partition)?;
        let inner = p.inner.read();
        inner.graph.as_ref().map(|g| g.get_nb_point())
    }

    /// Adds (or replaces) many entries at once: each partition is locked once; a partition
    /// that already has a graph gets the new points in one parallel pass. A partition that
    /// needs a graph and has none is left to exact scans until [`SemanticIndex::maintain`] or
    /// [`SemanticIndex::build_graphs`] builds it (the vectors are searchable as soon as this
    /// returns). This is the bulk load of a replica's rebuild and of a snapshot; it is CPU
    /// work, so call it off the async workers.
    pub fn insert_many(&self, items: Vec<IndexItem>) {
        let mut by_partition: HashMap<PartitionKey, Vec<IdVector>> = HashMap::new();
        for (partition, id, vector) in items {
            assert_eq!(vector.len(), self.dim, "vector dimension mismatch");
            let previous = self.location.write().insert(id, partition);
            if let Some(old) = previous {
                if let Some(p) = self.partition(&old) {
                    p.inner.write().tombstone(id);
                }
            }
            by_partition
                .entry(partition)
                .or_default()
                .push((id, vector));
        }
        for (partition, items) in by_partition {
            let ids: Vec<EntryId> = items.iter().map(|(id, _)| *id).collect();
            let p = self.push_into(partition, |this, inner| this.push_some(inner, items));
            self.settle(&partition, &p, &ids);
        }
    }

    /// Runs `push` on `partition` (created if needed) while the partition map is locked
    /// (shared in the common case), so that `maintain` cannot drop the partition between the
    /// lookup and the push; returns the partition.
    fn push_into(
        &self,
        partition: PartitionKey,
        push: impl FnOnce(&Self, &mut PartitionInner),
    ) -> Arc<Partition> {
        {
            let map = self.partitions.read();
            if let Some(p) = map.get(&partition) {
                push(self, &mut p.inner.write());
                return p.clone();
            }
        }
        let mut map = self.partitions.write();
        let p = map
            .entry(partition)
            .or_insert_with(|| Arc::new(Partition::new(self.next_epoch())));
        push(self, &mut p.inner.write());
        p.clone()
    }

    /// Whether `id` is indexed (and not removed).
    pub fn contains(&self, id: EntryId) -> bool {
        self.location.read().contains_key(&id)
    }

    /// The vector indexed for `id`: the very handle it was inserted with (the index shares
    /// it, never copies it).
    pub fn vector(&self, id: EntryId) -> Option<Vector> {
        let key = *self.location.read().get(&id)?;
        let p = self.partition(&key)?;
        let inner = p.inner.read();
        let slot = *inner.slot_of.get(&id)?;
        Some(inner.vectors[slot].clone())
    }

    /// Partitions searched through an HNSW graph (the others are scanned exactly).
    pub fn graphs(&self) -> usize {
        self.graph_summary().0
    }

    /// In one pass over the partitions: how many have a graph ([`SemanticIndex::graphs`]),
    /// and the widest search width among them ([`SemanticIndex::widest_search`]).
    pub fn graph_summary(&self) -> (usize, usize) {
        self.partitions
            .read()
            .values()
            .filter(|p| p.inner.read().graph.is_some())
            .fold((0, self.cfg.ef_search), |(n, widest), p| {
                (n + 1, widest.max(p.width.ef(&self.cfg)))
            })
    }

    /// Builds the graphs that partitions past [`IndexConfig::exact_scan_max`] still lack (a
    /// bulk load leaves them), each without holding its partition's lock, one partition at a
    /// time (each build is itself parallel); returns how many were built. Blocking: call it
    /// from `spawn_blocking`. [`SemanticIndex::maintain`] does this too, among its other work.
    pub fn build_graphs(&self) -> usize {
        let _one_at_a_time = self.maintaining.lock();
        let all: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut built = 0;
        for part in all {
            if part.inner.read().needs_graph(&self.cfg) {
                self.rebuild(&part);
                built += 1;
            }
        }
        built
    }

    /// Tombstones `id`; it is never returned by a search again. False if it was not present.
    pub fn remove(&self, id: EntryId) -> bool {
        let Some(key) = self.location.write().remove(&id) else {
            return false;
        };
        let Some(p) = self.partition(&key) else {
            return false;
        };
        let mut inner = p.inner.write();
        let removed = inner.tombstone(id);
        if removed && inner.worn(self.cfg.rebuild_tombstone_ratio) {
            self.worn.notify_one();
        }
        removed
    }

    /// The `k` entries of `partition` most similar to `query`, best first.
    pub fn search(&self, partition: &PartitionKey, query: &[f32], k: usize) -> Vec<Candidate> {
        self.search_wide(partition, query, k, None)
    }

    /// [`SemanticIndex::search`] with the graph's search width given (`None`: the configured
    /// `ef_search`); a benchmark's lever.
    pub fn search_wide(
        &self,
        partition: &PartitionKey,
        query: &[f32],
        k: usize,
        ef: Option<usize>,
    ) -> Vec<Candidate> {
        if k == 0 || query.len() != self.dim {
            return Vec::new();
        }
        let Some(p) = self.partition(partition) else {
            return Vec::new();
        };
        let inner = p.inner.read();
        if inner.graph.is_none() {
            return inner.search(query, k, 0, &self.graph);
        }
        GraphCounters::add(&self.graph.searches, 1);
        metrics::counter!("reprise_semantic_graph_searches_total").increment(1);
        let out = inner.search(
            query,
            k,
            ef.unwrap_or_else(|| p.width.ef(&self.cfg)),
            &self.graph,
        );
        // A width the caller gives (a benchmark's) is not the partition's: not sampled; nor
        // a search that found nothing live (nothing to have missed).
        if ef.is_none() && !out.is_empty() {
            self.samples.offer(self.cfg.recall_check_every, || Sample {
                key: *partition,
                query: query.into(),
                found: out[0].similarity,
                slots: inner.ids.len(),
                epoch: p.width.epoch.load(Ordering::Relaxed),
            });
        }
        out
    }

    /// The search width `partition`'s graph searches use (the configured `ef_search`, or
    /// wider once checks found its recall short); `None` when the partition does not exist.
    pub fn search_width(&self, partition: &PartitionKey) -> Option<usize> {
        self.partition(partition).map(|p| p.width.ef(&self.cfg))
    }

    /// The widest search width of any partition with a graph (the configured one when none
    /// was widened or no partition has a graph).
    pub fn widest_search(&self) -> usize {
        self.graph_summary().1
    }

    /// Checks the graph searches kept since the last call against exact scans of the same
    /// slots (see the `recall` module), widening the partitions that miss too often.
    fn check_recall(&self, report: &mut MaintainReport) {
        for s in self.samples.take() {
            let Some(p) = self.partition(&s.key) else {
                continue;
            };
            // The scan reads the partition a chunk at a time, letting go of it between
            // chunks: an insert waits at most one chunk's scan (a few hundred microseconds),
            // and searches queued behind that insert with it, never the whole partition's
            // (19 ms at 62,500 vectors). A rebuild between chunks renumbers the slots: the
            // sample is dropped.
            let mut exact: Option<f32> = None;
            let mut rebuilt = false;
            for from in (0..s.slots).step_by(RECALL_SCAN_CHUNK) {
                let inner = p.inner.read();
                if p.width.epoch.load(Ordering::Relaxed) != s.epoch {
                    rebuilt = true;
                    break;
                }
                let best = inner.best_in(&s.query, from..(from + RECALL_SCAN_CHUNK).min(s.slots));
                exact = exact.into_iter().chain(best).max_by(f32::total_cmp);
            }
            let (false, Some(exact)) = (rebuilt, exact) else {
                continue;
            };
            let missed = exact > s.found;
            report.recall_checked += 1;
            GraphCounters::add(&self.recall.checked, 1);
            let result = if missed {
                report.recall_missed += 1;
                GraphCounters::add(&self.recall.missed, 1);
                Checked::Missed
            } else {
                Checked::Found
            };
            metrics::counter!("reprise_semantic_recall_checks_total",
                "result" => if missed { "missed" } else { "found" })
            .increment(1);
            if let Some((wider, recall)) = p.width.record(result, &self.cfg) {
                report.widened += 1;
                GraphCounters::add(&self.recall.widened, 1);
                tracing::info!(
                    recall,
                    target = self.cfg.recall_target,
                    ef_search = wider,
                    vectors = p.inner.read().ids.len(),
                    "semantic index partition searches widened"
                );
            }
        }
    }

    /// Live entries across all partitions.
    pub fn len(&self) -> usize {
        self.location.read().len()
    }

    /// True when no live entry is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of partitions (including ones whose entries were all removed, until
    /// [`SemanticIndex::maintain`] drops them).
    pub fn partitions(&self) -> usize {
        self.partitions.read().len()
    }

    /// Rebuilds partitions whose tombstone ratio passed the configured limit and drops
    /// partitions with nothing live. Meant to be called periodically from a background task
    /// (it blocks: use `spawn_blocking`).
    ///
    /// A rebuild copies the live vectors under a read lock, builds the new structure with
    /// no lock held (searches and inserts go on meanwhile), then swaps it in under a short
    /// write lock, replaying what changed in between.
    pub fn maintain(&self) -> MaintainReport {
        let _one_at_a_time = self.maintaining.lock();
        let mut report = MaintainReport::default();
        let all: Vec<(PartitionKey, Arc<Partition>)> = self
            .partitions
            .read()
            .iter()
            .map(|(k, p)| (*k, Arc::clone(p)))
            .collect();
        for (key, part) in all {
            let (slots, dead) = {
                let inner = part.inner.read();
                (inner.ids.len(), inner.dead_count)
            };
            if slots > 0 && dead == slots {
                let mut map = self.partitions.write();
                // Re-check under the map lock: an insert may have raced in.
                let inner = part.inner.read();
                if inner.dead_count == inner.ids.len() {
                    map.remove(&key);
                    report.emptied += 1;
                }
                continue;
            }
            let (needs_graph, worn) = {
                let inner = part.inner.read();
                (
                    inner.needs_graph(&self.cfg),
                    inner.worn(self.cfg.rebuild_tombstone_ratio),
                )
            };
            if slots == 0 || !(worn || needs_graph) {
                continue;
            }
            report.tombstones_dropped += self.rebuild(&part);
            report.rebuilt += 1;
        }
        self.check_recall(&mut report);
        report
    }

    fn partition(&self, key: &PartitionKey) -> Option<Arc<Partition>> {
        self.partitions.read().get(key).cloned()
    }

    /// Rebuilds one partition without its tombstones; returns how many were dropped.
    fn rebuild(&self, part: &Partition) -> usize {
        let started = Instant::now();
        let (snapshot_len, live_slots, mut fresh) = {
            let inner = part.inner.read();
            let live: Vec<usize> = (0..inner.ids.len()).filter(|&s| !inner.dead[s]).collect();
            let mut fresh = PartitionInner::default();
            for &s in &live {
                fresh.push_flat(inner.ids[s], inner.vectors[s].clone());
            }
            (inner.ids.len(), live, fresh)
        };
        let big = fresh.ids.len() > self.cfg.exact_scan_max;
        if big {
            tracing::info!(
                live = fresh.ids.len(),
                dropped = snapshot_len - fresh.ids.len(),
                "rebuilding semantic index partition graph"
            );
            fresh.build_graph(&self.cfg);
            GraphCounters::add(&self.graph.builds, 1);
        }

        let mut inner = part.inner.write();
        // Replay what happened while building: removals of copied slots, and slots appended
        // after the snapshot.
        for (new_slot, &old_slot) in live_slots.iter().enumerate() {
            if inner.dead[old_slot] {
                fresh.dead[new_slot] = true;
                fresh.dead_count += 1;
            }
        }
        let mut outgrew = false;
        for s in snapshot_len..inner.ids.len() {
            if !inner.dead[s] {
                outgrew |= fresh.push(inner.ids[s], inner.vectors[s].clone(), &self.cfg);
            }
        }
        if outgrew {
            self.worn.notify_one();
        }
        let dropped = inner.ids.len() - fresh.ids.len();
        *inner = fresh;
        part.width.epoch.store(self.next_epoch(), Ordering::Relaxed);
        drop(inner);
        if big {
            tracing::info!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "semantic index partition rebuilt"
            );
        }
        dropped
    }
}

/// One partition. A `parking_lot::RwLock` because searches (readers) vastly outnumber
/// inserts and removals and run concurrently; writers hold it for one push or one flag flip
/// (plus one HNSW insertion, about a millisecond, in big partitions). parking_lot's lock is
/// fair enough that a steady stream of searches cannot starve a writer.
struct Partition {
    inner: RwLock<PartitionInner>,
    /// Its graph searches' width, widened when checks find their recall short (kept across
    /// rebuilds).
    width: recall::Width,
}

impl Partition {
    fn new(epoch: u64) -> Self {
        Partition {
            inner: RwLock::default(),
            width: recall::Width::new(epoch),
        }
    }
}

/// The graph of a big partition: its points are the partition's slot numbers (hnsw_rs ids are
/// `usize`), and each point's data is the slot's shared vector (one handle, not the floats).
type Graph = Hnsw<'static, Vector, DotDistance>;

/// Slots are append-only until a rebuild: slot `s` holds `ids[s]`, its vector `vectors[s]`
/// (shared with the entry) and `dead[s]`.
#[derive(Default)]
struct PartitionInner {
    ids: Vec<EntryId>,
    vectors: Vec<Vector>,
    dead: Vec<bool>,
    dead_count: usize,
    slot_of: HashMap<EntryId, usize>,
    graph: Option<Graph>,
    /// Its graph is to be built in the background (a bulk load left it, or an insert took
    /// the partition past exact scans and woke maintenance): asked once.
    graph_pending: bool,
}

impl PartitionInner {
    /// Appends without touching the graph.
    fn push_flat(&mut self, id: EntryId, vector: Vector) -> usize {
        let slot = self.ids.len();
        self.ids.push(id);
        self.vectors.push(vector);
        self.dead.push(false);
        if let Some(old) = self.slot_of.insert(id, slot) {
            // Same id pushed twice into one partition: the older slot dies.
            if !self.dead[old] {
                self.dead[old] = true;
                self.dead_count += 1;
            }
        }
        slot
    }

    /// Appends; a graph takes the vector. Whether the partition just outgrew exact scans
    /// (asked once; maintenance builds its graph).
    fn push(&mut self, id: EntryId, vector: Vector, cfg: &IndexConfig) -> bool {
        let slot = self.push_flat(id, vector);
        match &self.graph {
            Some(graph) => {
                graph.insert_slice((&self.vectors[slot..=slot], slot));
                false
            }
            // Building a graph over thousands of vectors inside an insert would stall the
            // request and, under the partition's write lock, every search and removal of the
            // partition: maintenance builds it off the request path (woken at once), and
            // exact scans serve meanwhile.
            // Asked once per crossing: a partition that fell back under the limit (removals)
            // asks again when it next crosses it.
            None => {
                let needs = self.needs_graph(cfg);
                let ask = needs && !self.graph_pending;
                self.graph_pending = needs;
                ask
            }
        }
    }

    /// Appends many; an existing graph is fed in one parallel pass, a missing one is left to
    /// the background.
    fn push_many(&mut self, items: Vec<IdVector>, cfg: &IndexConfig) {
        let first = self.ids.len();
        for (id, v) in items {
            self.push_flat(id, v);
        }
        match &self.graph {
            Some(graph) => {
                let data: Vec<(&[Vector], usize)> = (first..self.ids.len())
                    .map(|s| (&self.vectors[s..=s], s))
                    .collect();
                graph.parallel_insert_slice(&data);
            }
            None => self.graph_pending |= self.needs_graph(cfg),
        }
    }

    /// Big enough for a graph and without one.
    fn needs_graph(&self, cfg: &IndexConfig) -> bool {
        self.graph.is_none() && self.ids.len() - self.dead_count > cfg.exact_scan_max
    }

    /// Whether tombstones are `ratio` of the slots or more (and there are some).
    fn worn(&self, ratio: f32) -> bool {
        self.dead_count > 0 && (self.dead_count as f32) >= ratio * self.ids.len() as f32
    }

    fn tombstone(&mut self, id: EntryId) -> bool {
        match self.slot_of.remove(&id) {
            Some(slot) if !self.dead[slot] => {
                self.dead[slot] = true;
                self.dead_count += 1;
                true
            }
            _ => false,
        }
    }

    /// Builds the HNSW graph over every slot (dead ones too: they are filtered at search
    /// time, and a rebuild drops them later), in one parallel pass.
    fn build_graph(&mut self, cfg: &IndexConfig) {
        let n = self.ids.len();
        let graph = Hnsw::new(
            cfg.hnsw_m.clamp(2, 256),
            // A sizing hint for hnsw_rs, not a hard cap.
            (n * 2).max(4096),
            16,
            cfg.ef_construction.max(1),
            DotDistance,
        );
        let data: Vec<(&[Vector], usize)> = (0..n).map(|s| (&self.vectors[s..=s], s)).collect();
        graph.parallel_insert_slice(&data);
        self.graph = Some(graph);
        self.graph_pending = false;
    }

    /// The `k` live slots nearest `query`: through the graph at width `ef` (at least `k`)
    /// where there is one, else by an exact scan.
    fn search(
        &self,
        query: &[f32],
        k: usize,
        ef: usize,
        counters: &GraphCounters,
    ) -> Vec<Candidate> {
        let live = self.ids.len() - self.dead_count;
        if live == 0 {
            return Vec::new();
        }
        let mut out = match &self.graph {
            Some(graph) => {
                let dead = &self.dead;
                let ef = ef.max(k);
                let q = [Vector::new(query)];
                // hnsw_rs's filtered search does not stop once its nearest candidate is
                // farther than its farthest result: it walks on until no candidate is left,
                // about linear in the partition's size. Unfiltered it stops; asking for as
                // many more as the dead share of the slots would take covers tombstones, and
                // only a search still short of live results runs again with the filter.
                let slots = self.ids.len();
                let want = if self.dead_count == 0 {
                    k
                } else {
                    (k.saturating_mul(slots).div_ceil(live) + 2).min(slots)
                };
                let mut found: Vec<usize> = graph
                    .search(&q, want, ef.max(want))
                    .into_iter()
                    .map(|n| n.d_id)
                    .filter(|slot| !dead[*slot])
                    .collect();
                if self.dead_count > 0 && found.len() < k.min(live) {
                    GraphCounters::add(&counters.filtered, 1);
                    metrics::counter!("reprise_semantic_graph_filtered_searches_total")
                        .increment(1);
                    let keep = |slot: &usize| !dead[*slot];
                    found = graph
                        .search_filter(&q, k, ef, Some(&keep))
                        .into_iter()
                        .map(|n| n.d_id)
                        .filter(|slot| !dead[*slot])
                        .collect();
                }
                // Rescored exactly: the graph's distance is clamped.
                found
                    .into_iter()
                    .map(|slot| Candidate {
                        id: self.ids[slot],
                        similarity: self.vectors[slot].dot(query),
                    })
                    .collect::<Vec<_>>()
            }
            None => self.scan(query, k),
        };
        out.sort_by(|a, b| b.similarity.total_cmp(&a.similarity));
        out.truncate(k);
        out
    }

    /// The best similarity to `query` among the live vectors of the slots in `slots`.
    fn best_in(&self, query: &[f32], slots: std::ops::Range<usize>) -> Option<f32> {
        (slots.start.min(self.ids.len())..slots.end.min(self.ids.len()))
            .filter(|&s| !self.dead[s])
            .map(|s| self.vectors[s].dot(query))
            .max_by(f32::total_cmp)
    }

    /// Exact top-k by a linear scan.
    fn scan(&self, query: &[f32], k: usize) -> Vec<Candidate> {
        // Keep the k best in a small sorted vec: k is tiny (a handful) in practice.
        let mut best: Vec<Candidate> = Vec::with_capacity(k.min(self.vectors.len()) + 1);
        for (slot, v) in self.vectors.iter().enumerate() {
            if self.dead[slot] {
                continue;
            }
            let similarity = v.dot(query);
            if best.len() == k && similarity <= best[k - 1].similarity {
                continue;
            }
            let at = best.partition_point(|c| c.similarity >= similarity);
            best.insert(
                at,
                Candidate {
                    id: self.ids[slot],
                    similarity,
                },
            );
            best.truncate(k);
        }
        best
    }
}

/// `1 - dot` for normalised vectors, clamped at 0.
///
/// hnsw_rs's own `DistDot` asserts `1 - dot >= 0`, which rounding breaks for a vector and
/// itself (dot = 1.0000001), panicking; this one clamps instead.
#[derive(Debug, Clone, Copy, Default)]
struct DotDistance;

thread_local! {
    /// Distances [`DotDistance`] computed on this thread.
    static DISTANCES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many distances the graphs computed on the calling thread so far (builds and searches
/// it ran): what a search costs, counted where seconds are noisy (tests, benchmarks).
pub fn graph_distances_on_this_thread() -> u64 {
    DISTANCES.with(|d| d.get())
}

/// A graph point's data is one shared vector (a slice of one handle).
impl Distance<Vector> for DotDistance {
    fn eval(&self, va: &[Vector], vb: &[Vector]) -> f32 {
        DISTANCES.with(|d| d.set(d.get() + 1));
        (1.0 - va[0].dot_vector(&vb[0])).max(0.0)
    }
}

#[cfg(test)]
mod tests;
