//! Keeping a replica in step with the shared Redis tier.
//!
//! Every replica consumes the tier's event stream: an entry another replica wrote is fetched
//! into this replica's memory and semantic index (so it becomes an exact *and* semantic hit
//! here); deletions are applied locally. At start, and whenever the stream was missed
//! (`Resync`), the replica rebuilds from a scan of Redis in the background, logging progress;
//! exact hits keep being served from Redis meanwhile.

use std::sync::{Arc, Weak};

use futures::StreamExt;
use reprise_cache::redis::{RedisTier, ReplicationEvent};
use reprise_cache::{Entry, EntryId};

use crate::state::AppState;

/// Starts the replication task of `state` (which must have a Redis tier).
pub fn start(state: &Arc<AppState>) {
    let Some(redis) = state.redis.clone() else {
        return;
    };
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        // Subscribe before the rebuild so nothing written during the scan is missed.
        let mut events = redis.subscribe(true);
        rebuild(&weak, &redis).await;
        while let Some(ev) = events.next().await {
            let Some(state) = weak.upgrade() else { break };
            match ev {
                ReplicationEvent::Put { id, .. } => {
                    if let Ok(Some(entry)) = redis.get(id).await {
                        install(&state, entry).await;
                    }
                }
                ReplicationEvent::Delete { id } => remove_local(&state, id).await,
                ReplicationEvent::DeleteNamespace { namespace } => {
                    remove_where(&state, |e| e.namespace == namespace).await;
                }
                ReplicationEvent::Resync => {
                    drop(state);
                    rebuild(&weak, &redis).await;
                }
            }
        }
    });
}

/// Loads every live entry from Redis into memory and the index.
async fn rebuild(weak: &Weak<AppState>, redis: &RedisTier) {
    let started = std::time::Instant::now();
    tracing::info!("rebuilding the index from redis");
    let entries = match redis
        .scan_entries(|n| tracing::info!(entries = n, "index rebuild: scanned"))
        .await
    {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "index rebuild from redis failed; will retry on resync");
            return;
        }
    };
    let Some(state) = weak.upgrade() else { return };
    let total = entries.len();
    let mut vectors = Vec::new();
    for (i, entry) in entries.into_iter().enumerate() {
        if entry.is_expired() || state.memory.get(entry.id).await.is_some() {
            continue;
        }
        let entry = Arc::new(entry);
        state.memory.insert_entry(entry.clone()).await;
        if let (Some(sem), Some(v)) = (&state.semantic, &entry.embedding) {
            if indexable(sem.index.dim(), &entry, v) && !sem.index.contains(entry.id) {
                vectors.push((entry.partition, entry.id, v.clone()));
            }
        }
        if (i + 1) % 10_000 == 0 {
            tracing::info!(done = i + 1, total, "index rebuild: loaded into memory");
        }
    }
    if let Some(index) = state.semantic.as_ref().map(|s| s.index.clone()) {
        let n = vectors.len();
        tracing::info!(vectors = n, "index rebuild: indexing");
        // Graph construction is CPU work: off the async workers, one parallel pass per
        // partition.
        let _ = tokio::task::spawn_blocking(move || index.insert_many(vectors)).await;
    }
    state
        .rebuilds
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tracing::info!(
        entries = total,
        seconds = started.elapsed().as_secs_f64(),
        "index rebuilt from redis"
    );
}

/// Whether an entry's vector belongs in the index (right size, a real partition).
fn indexable(dim: usize, entry: &Entry, v: &[f32]) -> bool {
    v.len() == dim && entry.partition != [0; 32]
}

/// Puts an entry into this replica's memory and semantic index, unless it is already held
/// (then the held copy is returned and nothing is re-indexed).
pub async fn install(state: &AppState, entry: Entry) -> Arc<Entry> {
    if let Some(held) = state.memory.get(entry.id).await {
        return held;
    }
    let entry = Arc::new(entry);
    if entry.is_expired() {
        return entry;
    }
    state.memory.insert_entry(entry.clone()).await;
    if let (Some(sem), Some(embedding)) = (&state.semantic, &entry.embedding) {
        if indexable(sem.index.dim(), &entry, embedding) && !sem.index.contains(entry.id) {
            sem.index
                .insert(entry.partition, entry.id, embedding.clone());
        }
    }
    entry
}

/// Drops an entry from this replica (its vector is tombstoned by the eviction hook).
pub async fn remove_local(state: &AppState, id: EntryId) {
    state.memory.remove(id).await;
    if let Some(sem) = &state.semantic {
        sem.index.remove(id);
    }
}

/// Drops every local entry matching `pred`; returns how many.
pub async fn remove_where(state: &AppState, pred: impl Fn(&Entry) -> bool) -> u64 {
    let mut n = 0;
    for e in state.memory.iter_entries() {
        if pred(&e) {
            remove_local(state, e.id).await;
            n += 1;
        }
    }
    n
}
