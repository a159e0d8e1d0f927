//! Refresh-ahead and waste: hot entries close to expiry are queued for regeneration, and
//! prefetched entries that left the cache unused are counted as wasted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use reprise_backend::GenRequest;
use reprise_cache::{now_ms, EntryId};

use super::jobs::{Job, JobKind};
use super::{bump, Shared};
use crate::openai::Endpoint;
use crate::state::AppState;

/// An entry that gets hits: what to ask to regenerate it.
pub(super) struct Hot {
    pub(super) namespace: String,
    pub(super) endpoint: Endpoint,
    pub(super) request: GenRequest,
    pub(super) expires_ms: u64,
    pub(super) hits: AtomicU64,
    pub(super) refreshing: std::sync::atomic::AtomicBool,
}

impl Hot {
    /// About the bytes it holds (its request's texts; the budget of the hot records).
    pub(super) fn bytes(&self) -> usize {
        std::mem::size_of::<Hot>() + self.namespace.len() + self.request.heap_bytes()
    }
}

impl Shared {
    /// Queues refresh jobs for hot entries close to expiry.
    pub(super) async fn scan_hot(&self, state: &AppState) {
        let now = now_ms();
        let window = (self.cfg.refresh_window_secs * 1000.0) as u64;
        let mut gone = Vec::new();
        let mut due = Vec::new();
        for (id, hot) in self.hot.iter() {
            if hot.expires_ms <= now {
                gone.push(*id);
            } else if hot.expires_ms.saturating_sub(now) <= window
                && hot.hits.load(Ordering::Relaxed) >= self.cfg.refresh_min_hits
                && !hot.refreshing.load(Ordering::Relaxed)
            {
                due.push((*id, hot));
            }
        }
        for id in gone {
            self.hot.invalidate(&id);
        }
        for (id, hot) in due {
            let Some(old) = state.store.get(id).await else {
                self.hot.invalidate(&id);
                continue;
            };
            hot.refreshing.store(true, Ordering::Relaxed);
            let mut request = hot.request.clone();
            request.priority = reprise_backend::Priority::Background;
            let key = crate::key::exact_key(&hot.namespace, hot.endpoint, &request);
            let queued = self.enqueue(Job {
                kind: JobKind::Refresh(id),
                namespace: hot.namespace.clone(),
                endpoint: hot.endpoint,
                request,
                key,
                aliases: Vec::new(),
                // The renewed entry keeps the tags of the one it replaces.
                tags: old.tags.clone(),
                queued_at: Instant::now(),
            });
            // Already queued (a prefetch of the same request): tried again on a later scan.
            if !queued {
                hot.refreshing.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Counts prefetched entries that left the cache without being used.
    pub(super) fn scan_wasted(&self, state: &AppState) {
        let now = now_ms();
        let ids: Vec<(EntryId, u64)> = self
            .prefetched
            .lock()
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
        // Whether each is still held, without reading it: a read would make every unused
        // prefetched entry recently used at each scan, and keep it from being evicted.
        let wasted: Vec<EntryId> = ids
            .into_iter()
            .filter(|&(id, expires)| expires <= now || !state.store.holds(id))
            .map(|(id, _)| id)
            .collect();
        if wasted.is_empty() {
            return;
        }
        let mut map = self.prefetched.lock();
        let mut n = 0;
        for id in wasted {
            // Still there: not used meanwhile.
            if map.remove(&id).is_some() {
                n += 1;
            }
        }
        drop(map);
        bump(&self.counts.wasted, n);
        self.handles.wasted.increment(n);
    }
}
