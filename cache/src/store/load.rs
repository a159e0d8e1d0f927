//! Bulk loads: a replica's rebuild from Redis (streamed, within the memory budget) and a
//! snapshot's load.

use std::sync::Arc;

use super::Store;
use crate::entry::{Digest, Entry, EntryId};
use crate::semantic::IndexItem;

/// What a bulk load ([`Store::load`]) installed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// Entries put into memory (expired ones and ones already held are skipped).
    pub entries: usize,
    /// Vectors added to the index.
    pub vectors: usize,
    /// Keys pointed at entries.
    pub keys: usize,
    /// Loading stopped at the memory tier's capacity: the rest was left in Redis (found
    /// there on demand).
    pub stopped_at_budget: bool,
}

impl Store {
    /// Bulk load (replica rebuild, snapshot): entries into memory, then keys, then every
    /// vector into the index off the async workers; big partitions' graphs are built after
    /// this returns, in the background. Entries already held and
    /// expired ones are skipped. `progress` is called with the count of entries handled
    /// every 10,000.
    pub async fn load(
        &self,
        entries: impl IntoIterator<Item = Entry>,
        keys: Vec<(Digest, EntryId)>,
        progress: impl Fn(usize),
    ) -> Loaded {
        let mut loaded = Loaded::default();
        let mut vectors = Vec::new();
        for (i, entry) in entries.into_iter().enumerate() {
            if (i + 1) % 10_000 == 0 {
                progress(i + 1);
            }
            self.load_one(entry, &mut loaded, &mut vectors).await;
        }
        self.finish_load(keys, loaded, vectors).await
    }

    /// [`Store::load`] of entries arriving in pages (a replica's rebuild streaming from
    /// Redis), never more than the memory tier holds: once the entries loaded weigh its
    /// capacity, the rest is left where it is (`stopped_at_budget`; Redis still serves them
    /// on demand), except that entries this replica already holds still take the refusals
    /// their Redis copies have (a question reported wrong elsewhere is not served them
    /// again here); with none held, `pages` is dropped then, which stops the sender.
    pub async fn load_pages(
        &self,
        mut pages: tokio::sync::mpsc::Receiver<Vec<Entry>>,
        progress: impl Fn(usize),
    ) -> Loaded {
        let mut loaded = Loaded::default();
        let mut vectors = Vec::new();
        let (budget, mut bytes, mut seen) = (self.memory.capacity(), 0u64, 0usize);
        self.memory.run_pending_tasks().await;
        let held_before = self.memory.entry_count() > 0;
        'pages: while let Some(page) = pages.recv().await {
            // Expired entries kept in Redis to be served stale are not loaded (nor counted
            // against the budget): found there on demand.
            for entry in page.into_iter().filter(|e| !e.is_expired()) {
                if !loaded.stopped_at_budget {
                    bytes += u64::from(self.memory.weight_of(&entry));
                    loaded.stopped_at_budget = bytes > budget;
                    if loaded.stopped_at_budget && !held_before {
                        break 'pages;
                    }
                }
                if loaded.stopped_at_budget {
                    if self.memory.holds(entry.id) {
                        if let Some(held) = self.memory.get(entry.id).await {
                            self.merge_refusals(held, &entry).await;
                        }
                    }
                    continue;
                }
                self.load_one(entry, &mut loaded, &mut vectors).await;
                seen += 1;
                if seen % 10_000 == 0 {
                    progress(seen);
                }
            }
        }
        drop(pages);
        self.finish_load(Vec::new(), loaded, vectors).await
    }

    /// One entry of a bulk load into memory; its vector is indexed by [`Store::finish_load`].
    async fn load_one(&self, entry: Entry, loaded: &mut Loaded, vectors: &mut Vec<IndexItem>) {
        if entry.is_expired() || self.gone(&entry) {
            return;
        }
        if let Some(held) = self.memory.get(entry.id).await {
            // Held already: only refusals it may have missed are taken.
            self.merge_refusals(held, &entry).await;
            return;
        }
        let entry = Arc::new(entry);
        let vector = self.indexable(&entry);
        if !self.memory.insert_entry(entry.clone()).await || !self.undo_if_gone(&entry).await {
            return;
        }
        if let Some(v) = vector {
            vectors.push((entry.partition, entry.id, v));
        }
        loaded.entries += 1;
    }

    /// The end of a bulk load: keys, then the vectors placed in the index (graphs after).
    async fn finish_load(
        &self,
        keys: Vec<(Digest, EntryId)>,
        mut loaded: Loaded,
        vectors: Vec<IndexItem>,
    ) -> Loaded {
        loaded.keys = self.load_keys(keys).await;
        if let Some(index) = self.index.clone() {
            // The vectors are searchable (exact scans) once placed; the graphs of big
            // partitions are built after, in the background (CPU work, one parallel pass per
            // partition), so lookups need not wait for them. Entries the load itself evicted
            // (each insert runs memory's housekeeping) lose their vector again: their
            // eviction hook ran before the vector was placed.
            let placed = index.clone();
            let memory = self.memory.clone();
            loaded.vectors = tokio::task::spawn_blocking(move || {
                let ids: Vec<EntryId> = vectors.iter().map(|(_, id, _)| *id).collect();
                placed.insert_many(vectors);
                let gone = ids.iter().filter(|id| !memory.holds(**id));
                ids.len() - gone.filter(|id| placed.remove(**id)).count()
            })
            .await
            .unwrap_or(0);
            tokio::task::spawn_blocking(move || index.build_graphs());
        }
        loaded
    }

    /// The keys of a bulk load, each pointed at its entry when memory holds that entry (a key
    /// of an entry the load did not keep would only take room); returns how many.
    pub async fn load_keys(&self, keys: Vec<(Digest, EntryId)>) -> usize {
        let mut n = 0;
        for (k, id) in keys {
            if self.memory.holds(id) {
                self.memory.alias(k, id).await;
                n += 1;
            }
        }
        n
    }
}
