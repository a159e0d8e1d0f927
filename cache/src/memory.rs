//! The in-process tier (moka): entries by id, bounded by bytes, each expiring at its own
//! time; and exact keys (and aliases) pointing at entry ids.
//!
//! Keys and entries live in two caches so that many keys (every exact phrasing that was ever
//! served an entry) can point at one copy of the answer. A key whose entry was evicted is a
//! miss and is dropped on sight.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::future::Cache;
use moka::notification::RemovalCause;

use crate::entry::{Digest, Entry, EntryId};

/// Per-entry expiry: an entry lives until its own `expires_ms`.
struct EntryExpiry;

impl moka::Expiry<EntryId, Arc<Entry>> for EntryExpiry {
    fn expire_after_create(
        &self,
        _key: &EntryId,
        value: &Arc<Entry>,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(value.ttl_left())
    }

    fn expire_after_update(
        &self,
        _key: &EntryId,
        value: &Arc<Entry>,
        _updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.ttl_left())
    }
}

/// Called when an entry leaves the memory tier for any reason but replacement.
pub type EvictionHook = Arc<dyn Fn(EntryId, Arc<Entry>, RemovalCause) + Send + Sync>;

/// Approximate cost of one key → id mapping, charged against the key cache's budget.
const KEY_WEIGHT: u32 = 96;

/// The in-process tier.
#[derive(Clone)]
pub struct MemoryTier {
    entries: Cache<EntryId, Arc<Entry>>,
    keys: Cache<Digest, EntryId>,
}

impl MemoryTier {
    /// A tier holding up to `max_bytes` of entries (keys get an eighth of that on top),
    /// keeping keys for at most `key_ttl`.
    pub fn new(max_bytes: u64, key_ttl: Duration, on_evict: Option<EvictionHook>) -> Self {
        let mut builder = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_k: &EntryId, v: &Arc<Entry>| v.weight())
            .expire_after(EntryExpiry);
        if let Some(hook) = on_evict {
            builder = builder.eviction_listener(move |k: Arc<EntryId>, v, cause| {
                if cause != RemovalCause::Replaced {
                    hook(*k, v, cause);
                }
            });
        }
        let keys = Cache::builder()
            .max_capacity((max_bytes / 8).max(u64::from(KEY_WEIGHT)))
            .weigher(|_k: &Digest, _v: &EntryId| KEY_WEIGHT)
            .time_to_live(key_ttl)
            .build();
        MemoryTier {
            entries: builder.build(),
            keys,
        }
    }

    /// The entry an exact key points at, if both are still held and not expired.
    pub async fn get_by_key(&self, key: &Digest) -> Option<Arc<Entry>> {
        let id = self.keys.get(key).await?;
        match self.get(id).await {
            Some(e) => Some(e),
            None => {
                self.keys.invalidate(key).await;
                None
            }
        }
    }

    /// An entry by id, if held and not expired.
    pub async fn get(&self, id: EntryId) -> Option<Arc<Entry>> {
        let e = self.entries.get(&id).await?;
        if e.is_expired() {
            self.entries.invalidate(&id).await;
            return None;
        }
        Some(e)
    }

    /// Stores an entry and points `key` at it.
    pub async fn insert(&self, key: Digest, entry: Arc<Entry>) {
        let id = entry.id;
        self.entries.insert(id, entry).await;
        self.keys.insert(key, id).await;
    }

    /// Stores an entry without a key (it is reached by id, e.g. through the semantic index).
    pub async fn insert_entry(&self, entry: Arc<Entry>) {
        self.entries.insert(entry.id, entry).await;
    }

    /// Points another exact key at an existing entry.
    pub async fn alias(&self, key: Digest, id: EntryId) {
        self.keys.insert(key, id).await;
    }

    /// Drops an entry (its keys become misses).
    pub async fn remove(&self, id: EntryId) {
        self.entries.invalidate(&id).await;
    }

    /// Drops every entry and key.
    pub fn clear(&self) {
        self.entries.invalidate_all();
        self.keys.invalidate_all();
    }

    /// Number of entries held (approximate until pending work runs).
    pub fn entry_count(&self) -> u64 {
        self.entries.entry_count()
    }

    /// Bytes held (approximate until pending work runs).
    pub fn weighted_size(&self) -> u64 {
        self.entries.weighted_size()
    }

    /// Runs moka's pending maintenance (evictions, expiry notifications) now.
    pub async fn run_pending_tasks(&self) {
        self.entries.run_pending_tasks().await;
        self.keys.run_pending_tasks().await;
    }

    /// A snapshot of the exact keys and aliases and the entries they point at.
    pub fn iter_keys(&self) -> Vec<(Digest, EntryId)> {
        self.keys.iter().map(|(k, v)| (*k, v)).collect()
    }

    /// The keys that lead to entry `id` (a scan of every key: for rare maintenance, off the
    /// async threads).
    pub fn keys_of(&self, id: EntryId) -> Vec<Digest> {
        self.keys
            .iter()
            .filter(|(_, v)| *v == id)
            .map(|(k, _)| *k)
            .collect()
    }

    /// A snapshot of the live entries (for index rebuilds and admin listings).
    pub fn iter_entries(&self) -> Vec<Arc<Entry>> {
        self.entries.iter().map(|(_, v)| v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::{now_ms, Origin};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn entry(text: &str, ttl_ms: u64) -> Arc<Entry> {
        Arc::new(Entry {
            id: EntryId::random(),
            namespace: "ns".into(),
            model: "m".into(),
            text: text.into(),
            finish_reason: "stop".into(),
            prompt_tokens: 1,
            completion_tokens: 1,
            prompt: "p".into(),
            partition: [0; 32],
            embedding: None,
            origin: Origin::Live,
            tags: Vec::new(),
            created_ms: now_ms(),
            expires_ms: now_ms() + ttl_ms,
        })
    }

    #[tokio::test]
    async fn keys_and_aliases_reach_the_entry() {
        let t = MemoryTier::new(1 << 20, Duration::from_secs(60), None);
        let e = entry("hello", 60_000);
        t.insert([1; 32], e.clone()).await;
        t.alias([2; 32], e.id).await;
        assert_eq!(t.get_by_key(&[1; 32]).await.unwrap().text, "hello");
        assert_eq!(t.get_by_key(&[2; 32]).await.unwrap().id, e.id);
        assert!(t.get_by_key(&[3; 32]).await.is_none());
        t.remove(e.id).await;
        assert!(t.get_by_key(&[2; 32]).await.is_none());
    }

    #[tokio::test]
    async fn entries_expire_at_their_own_time() {
        let t = MemoryTier::new(1 << 20, Duration::from_secs(60), None);
        let short = entry("short", 50);
        let long = entry("long", 60_000);
        t.insert([1; 32], short).await;
        t.insert([2; 32], long).await;
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert!(t.get_by_key(&[1; 32]).await.is_none());
        assert!(t.get_by_key(&[2; 32]).await.is_some());
    }

    #[tokio::test]
    async fn bounded_by_bytes_with_eviction_hook() {
        let evicted = Arc::new(AtomicUsize::new(0));
        let ev = evicted.clone();
        let hook: EvictionHook = Arc::new(move |_, _, _| {
            ev.fetch_add(1, Ordering::SeqCst);
        });
        let one = entry(&"x".repeat(1000), 60_000).weight() as u64;
        let t = MemoryTier::new(one * 10, Duration::from_secs(60), Some(hook));
        for i in 0..50u8 {
            t.insert([i; 32], entry(&"x".repeat(1000), 60_000)).await;
            t.run_pending_tasks().await;
        }
        t.run_pending_tasks().await;
        assert!(t.weighted_size() <= one * 10, "{}", t.weighted_size());
        assert!(evicted.load(Ordering::SeqCst) >= 40);
    }
}
