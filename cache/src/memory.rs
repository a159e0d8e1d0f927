//! The in-process tier (moka): entries by id, bounded by bytes, each expiring at its own
//! time; and exact keys (and aliases) pointing at entry ids.
//!
//! Keys and entries live in two caches so that many keys (every exact phrasing that was ever
//! served an entry) can point at one copy of the answer. A key whose entry was evicted is a
//! miss and is dropped on sight.
//!
//! With a retention (`retain`, the longest stale window), an expired entry stays held that
//! long past its expiry, still weighing in the byte budget, so that it can be served stale
//! (RFC 5861). The ordinary reads ([`MemoryTier::get`], [`MemoryTier::get_by_key`]) never
//! return it; only the `*_kept` reads do.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use moka::future::Cache;
use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;

use crate::entry::{Digest, Entry, EntryId};
use crate::shares::{Evicted, EvictedQueue, Ledgers, MemoryShares};

/// Per-entry expiry: an entry lives until its own `expires_ms`, plus the retention of
/// expired entries (milliseconds).
struct EntryExpiry(u64);

impl moka::Expiry<EntryId, Arc<Entry>> for EntryExpiry {
    fn expire_after_create(
        &self,
        _key: &EntryId,
        value: &Arc<Entry>,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(value.kept_left(self.0))
    }

    fn expire_after_update(
        &self,
        _key: &EntryId,
        value: &Arc<Entry>,
        _updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.kept_left(self.0))
    }
}

/// What `entry` weighs while held: see [`MemoryTier::weight_of`].
fn held_weight(entry: &Entry, index_charge: Option<IndexCharge>) -> u32 {
    let indexed = index_charge
        .filter(|c| entry.embedding.as_ref().is_some_and(|v| v.len() == c.dim))
        .map_or(0, |c| c.bytes);
    entry
        .weight()
        .saturating_add(ITEM_OVERHEAD)
        .saturating_add(indexed)
}

/// Called when an entry leaves the memory tier for any reason but replacement.
pub type EvictionHook = Arc<dyn Fn(EntryId, Arc<Entry>, RemovalCause) + Send + Sync>;

/// What moka holds for each cached item besides the item itself (its node, the hash table's
/// slot, the access and expiry bookkeeping) plus the `Arc`'s header: about 280–340 bytes
/// requested, measured with a counting allocator (`tests/store_memory.rs` holds the tier to
/// its budget), and malloc's header and rounding for its five or so allocations (about 16
/// bytes each: `reprise-bench soak` compares malloc's live bytes with the budget).
pub const ITEM_OVERHEAD: u32 = 400;

/// Cost of one key → id mapping (the 32-byte key and 16-byte id inside moka's bookkeeping),
/// charged against the key cache's budget.
const KEY_WEIGHT: u32 = ITEM_OVERHEAD;

/// What an entry whose vector the semantic index holds costs there, charged to the entry in
/// the memory budget (see [`crate::semantic::SemanticIndex::charge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexCharge {
    /// The index's dimension: an entry whose embedding has it is charged.
    pub dim: usize,
    /// Bytes charged per such entry.
    pub bytes: u32,
}

/// The in-process tier.
#[derive(Clone)]
pub struct MemoryTier {
    entries: Cache<EntryId, Arc<Entry>>,
    keys: Cache<Digest, EntryId>,
    /// What an indexed entry costs the index, charged to it here.
    index_charge: Option<IndexCharge>,
    /// The pools' ledgers when the budget is shared out ([`MemoryTier::set_shares`]).
    ledgers: Arc<ArcSwapOption<Ledgers>>,
    /// What the ledgers evicted, to drop from the tier.
    evicted: EvictedQueue,
    /// Entries being dropped because their pool's ledger evicted them: the tier removes
    /// them by hand, and the hook hears of an eviction for the size, as for the tier's own.
    pool_evicting: Arc<parking_lot::Mutex<HashSet<EntryId>>>,
    /// The shares in force and their version; held while they change, so changes apply one
    /// at a time and never an older one after a newer.
    shares: Arc<parking_lot::Mutex<(Option<MemoryShares>, u64)>>,
    key_ttl: Duration,
    /// How long expired entries stay held past their expiry, milliseconds.
    retain_ms: u64,
    max_bytes: u64,
}

impl MemoryTier {
    /// A tier holding up to `max_bytes` of entries (keys get an eighth of that on top),
    /// keeping keys for at most `key_ttl` and expired entries (and their keys) `retain` past
    /// their expiry.
    pub fn new(
        max_bytes: u64,
        key_ttl: Duration,
        retain: Duration,
        on_evict: Option<EvictionHook>,
    ) -> Self {
        Self::with_index_charge(max_bytes, key_ttl, retain, on_evict, None)
    }

    /// [`MemoryTier::new`], charging each entry with an embedding of the index's dimension
    /// what the index holds for it: one budget bounds entries and their vectors' index.
    pub fn with_index_charge(
        max_bytes: u64,
        key_ttl: Duration,
        retain: Duration,
        on_evict: Option<EvictionHook>,
        index_charge: Option<IndexCharge>,
    ) -> Self {
        let retain_ms = u64::try_from(retain.as_millis()).unwrap_or(u64::MAX);
        // A key outlives its entry's expiry by the retention, so it still leads to the entry
        // while that may be served stale.
        let key_ttl = key_ttl.saturating_add(retain);
        let ledgers: Arc<ArcSwapOption<Ledgers>> = Arc::default();
        let forget = ledgers.clone();
        let pool_evicting: Arc<parking_lot::Mutex<HashSet<EntryId>>> = Arc::default();
        let by_pool = pool_evicting.clone();
        // Least recently used first (moka's default admission turns away a newcomer no more
        // often read than its victim: every new answer, once the tier is full of answers
        // nobody read again).
        let entries = Cache::builder()
            .eviction_policy(EvictionPolicy::lru())
            .max_capacity(max_bytes)
            .weigher(move |_k: &EntryId, v: &Arc<Entry>| held_weight(v, index_charge))
            .expire_after(EntryExpiry(retain_ms))
            .eviction_listener(move |k: Arc<EntryId>, v: Arc<Entry>, cause| {
                if cause == RemovalCause::Replaced {
                    return;
                }
                if let Some(l) = &*forget.load() {
                    l.of(&v.namespace).forget(*k);
                }
                if let Some(hook) = &on_evict {
                    let cause = match cause {
                        RemovalCause::Explicit if by_pool.lock().contains(&*k) => {
                            RemovalCause::Size
                        }
                        cause => cause,
                    };
                    hook(*k, v, cause);
                }
            })
            .build();
        let keys = Cache::builder()
            .eviction_policy(EvictionPolicy::lru())
            .max_capacity((max_bytes / 8).max(u64::from(KEY_WEIGHT)))
            .weigher(|_k: &Digest, _v: &EntryId| KEY_WEIGHT)
            .time_to_live(key_ttl)
            .build();
        MemoryTier {
            entries,
            keys,
            index_charge,
            ledgers,
            evicted: EvictedQueue::default(),
            pool_evicting,
            shares: Arc::default(),
            key_ttl,
            retain_ms,
            max_bytes,
        }
    }

    /// Shares the byte budget out among pools (`None`: one budget for all, as at start).
    /// Held entries and keys are recorded in their pools' ledgers at once; what no longer
    /// fits its pool leaves the tier with the next write (or [`MemoryTier::settle`]).
    /// Scans the tier: a rare operator action, not for the request path. `version` orders
    /// changes: shares older than the ones in force are ignored.
    pub fn set_shares(&self, shares: Option<MemoryShares>, version: u64) {
        let mut current = self.shares.lock();
        if version < current.1 {
            return;
        }
        current.1 = version;
        let same = |a: &MemoryShares, b: &MemoryShares| a.pools == b.pools && a.rest == b.rest;
        match (&current.0, &shares) {
            (None, None) => return,
            (Some(a), Some(b)) if same(a, b) => return,
            _ => {}
        }
        current.0.clone_from(&shares);
        let Some(shares) = shares else {
            self.ledgers.store(None);
            return;
        };
        let ledgers = Arc::new(Ledgers::new(
            &shares,
            KEY_WEIGHT,
            self.key_ttl,
            self.retain_ms,
            &self.evicted,
        ));
        // Writes from now on record themselves in the new ledgers; the pass records what is
        // held (a write racing the swap may go unrecorded: bounded still by the tier's own
        // budget, it leaves with its expiry).
        self.ledgers.store(Some(ledgers.clone()));
        self.record_all(&ledgers);
    }

    /// What `entry` weighs in this tier's budget: its own bytes, moka's bookkeeping and, when
    /// its vector is indexed, the index's share.
    pub fn weight_of(&self, entry: &Entry) -> u32 {
        held_weight(entry, self.index_charge)
    }

    /// Records every held entry and its keys not yet recorded in `ledgers`, oldest entry
    /// first: where a pool holds more than its share, its newest entries and keys stay.
    fn record_all(&self, ledgers: &Ledgers) {
        let mut keys: HashMap<EntryId, Vec<Digest>> = HashMap::new();
        for (k, id) in self.keys.iter() {
            keys.entry(id).or_default().push(*k);
        }
        let mut held: Vec<Arc<Entry>> = self.entries.iter().map(|(_, e)| e).collect();
        held.sort_unstable_by_key(|e| e.created_ms);
        for e in held {
            let ledger = ledgers.of(&e.namespace);
            if ledger.holds(e.id) || ledger.record_entry(&e, self.weight_of(&e)) {
                for k in keys.remove(&e.id).unwrap_or_default() {
                    ledger.record_key(k);
                }
            }
        }
    }

    /// Bytes of entries recorded in the pool of `namespace` (`None` without shares).
    pub fn pool_size(&self, namespace: &str) -> Option<u64> {
        Some(self.ledgers.load().as_ref()?.pool_size(namespace))
    }

    /// Drops from the tier what the pools' ledgers evicted.
    pub async fn settle(&self) {
        let evicted = std::mem::take(&mut *self.evicted.lock());
        for e in evicted {
            match e {
                Evicted::Entry(id) => {
                    self.pool_evicting.lock().insert(id);
                    self.entries.invalidate(&id).await;
                    self.pool_evicting.lock().remove(&id);
                }
                Evicted::Key(k) => self.keys.invalidate(&k).await,
            }
        }
    }

    /// Records a new entry (and its key) in its pool before it enters the tier; whether it
    /// may enter. Without shares, always.
    async fn admit(&self, entry: &Entry, key: Option<Digest>) -> bool {
        let Some(ledgers) = self.ledgers.load_full() else {
            return true;
        };
        let ledger = ledgers.of(&entry.namespace);
        let kept = ledger.record_entry(entry, self.weight_of(entry));
        if let (true, Some(k)) = (kept, key) {
            ledger.record_key(k);
        }
        self.settle().await;
        kept
    }

    /// The entry an exact key points at, if both are still held and not expired. A key whose
    /// entry is held expired stays (it leads to a stale answer, [`MemoryTier::get_kept_by_key`]).
    pub async fn get_by_key(&self, key: &Digest) -> Option<Arc<Entry>> {
        let e = self.get_kept_by_key(key).await?;
        if e.is_expired() {
            return None;
        }
        self.touch(&e);
        Some(e)
    }

    /// The entry an exact key points at, if both are still held, expired or not (an expired
    /// one is held only within the retention).
    pub async fn get_kept_by_key(&self, key: &Digest) -> Option<Arc<Entry>> {
        let id = self.keys.get(key).await?;
        match self.get_kept(id).await {
            // An entry reported wrong for this key's question is not reached by it.
            Some(e) if !e.refuses_key(key) => Some(e),
            _ => {
                self.keys.invalidate(key).await;
                None
            }
        }
    }

    /// An entry by id, if held and not expired.
    pub async fn get(&self, id: EntryId) -> Option<Arc<Entry>> {
        let e = self.get_kept(id).await?;
        if e.is_expired() {
            return None;
        }
        self.touch(&e);
        Some(e)
    }

    /// An entry by id, if held, expired or not. Reading an expired entry does not make it
    /// recently used in its pool: a stale answer should not keep fresh ones out.
    pub async fn get_kept(&self, id: EntryId) -> Option<Arc<Entry>> {
        let e = self.entries.get(&id).await?;
        if e.kept_left(self.retain_ms).is_zero() {
            self.entries.invalidate(&id).await;
            return None;
        }
        Some(e)
    }

    /// A read of `e`: it becomes the most recently used of its pool (the ordinary reads do
    /// this; a caller of a `*_kept` read that uses an unexpired entry calls it).
    pub fn touch(&self, e: &Entry) {
        if let Some(ledgers) = &*self.ledgers.load() {
            ledgers.of(&e.namespace).touch(e.id);
        }
    }

    /// Stores an entry and points `key` at it; `false` when its pool's share refused it
    /// (nothing stored).
    pub async fn insert(&self, key: Digest, entry: Arc<Entry>) -> bool {
        if !self.admit(&entry, Some(key)).await {
            return false;
        }
        let id = entry.id;
        let namespace = entry.namespace.clone();
        self.entries.insert(id, entry).await;
        self.keys.insert(key, id).await;
        self.recheck(id, &namespace).await;
        true
    }

    /// Stores an entry without a key (it is reached by id, e.g. through the semantic index);
    /// `false` when its pool's share refused it (nothing stored).
    pub async fn insert_entry(&self, entry: Arc<Entry>) -> bool {
        let admitted = self.admit(&entry, None).await;
        if admitted {
            let (id, namespace) = (entry.id, entry.namespace.clone());
            self.entries.insert(id, entry).await;
            self.recheck(id, &namespace).await;
        }
        admitted
    }

    /// After an insert: an entry its pool evicted between being recorded and entering the
    /// tier (another write of the pool settled that eviction first) leaves now, so nothing
    /// stays in the tier unrecorded.
    async fn recheck(&self, id: EntryId, namespace: &str) {
        let evicted = match &*self.ledgers.load() {
            Some(ledgers) => !ledgers.of(namespace).holds(id),
            None => false,
        };
        if evicted {
            self.entries.invalidate(&id).await;
        }
    }

    /// Points another exact key at an existing entry (with shares, only at a held one: the
    /// key is charged to the entry's pool).
    pub async fn alias(&self, key: Digest, id: EntryId) {
        if let Some(ledgers) = self.ledgers.load_full() {
            let Some(e) = self.entries.get(&id).await else {
                return;
            };
            ledgers.of(&e.namespace).record_key(key);
            self.settle().await;
        }
        self.keys.insert(key, id).await;
    }

    /// Whether the tier holds entry `id` now (not a read: its recency is untouched). An
    /// entry evicted by size is gone from here before its eviction hook runs.
    pub fn holds(&self, id: EntryId) -> bool {
        self.entries.contains_key(&id)
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

    /// The bytes of entries the tier holds at most.
    pub fn capacity(&self) -> u64 {
        self.max_bytes
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
        self.settle().await;
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

    /// A snapshot of the entries held, expired ones kept for stale serving included (for
    /// snapshots, admin listings and deletions).
    pub fn iter_entries(&self) -> Vec<Arc<Entry>> {
        self.entries.iter().map(|(_, v)| v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::{now_ms, Origin};
    use crate::shares::RECORD_BYTES;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn entry(text: &str, ttl_ms: u64) -> Arc<Entry> {
        entry_in("ns", text, ttl_ms)
    }

    fn entry_in(namespace: &str, text: &str, ttl_ms: u64) -> Arc<Entry> {
        Arc::new(Entry {
            id: EntryId::random(),
            namespace: namespace.into(),
            model: "m".into(),
            text: text.into(),
            finish_reason: "stop".into(),
            prompt_tokens: 1,
            completion_tokens: 1,
            prompt: "p".into(),
            partition: [0; 32],
            embedding: None,
            embedder: None,
            origin: Origin::Live,
            tags: Vec::new(),
            refusals: Vec::new(),
            created_ms: now_ms(),
            expires_ms: now_ms() + ttl_ms,
            gen_ms: 0,
        })
    }

    #[tokio::test]
    async fn keys_and_aliases_reach_the_entry() {
        let t = MemoryTier::new(1 << 20, Duration::from_secs(60), Duration::ZERO, None);
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
        let t = MemoryTier::new(1 << 20, Duration::from_secs(60), Duration::ZERO, None);
        let short = entry("short", 50);
        let long = entry("long", 60_000);
        t.insert([1; 32], short).await;
        t.insert([2; 32], long).await;
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert!(t.get_by_key(&[1; 32]).await.is_none());
        assert!(t.get_by_key(&[2; 32]).await.is_some());
    }

    #[tokio::test]
    async fn expired_entries_are_kept_for_the_retention_and_read_only_as_kept() {
        let t = MemoryTier::new(
            1 << 20,
            Duration::from_millis(50),
            Duration::from_millis(400),
            None,
        );
        let e = entry("stale soon", 50);
        t.insert([1; 32], e.clone()).await;
        assert!(t.get_by_key(&[1; 32]).await.is_some());
        tokio::time::sleep(Duration::from_millis(120)).await;
        // Expired: never fresh, but kept (and its key with it) within the retention.
        assert!(t.get_by_key(&[1; 32]).await.is_none());
        assert!(t.get(e.id).await.is_none());
        assert_eq!(t.get_kept_by_key(&[1; 32]).await.map(|k| k.id), Some(e.id));
        assert_eq!(t.get_kept(e.id).await.map(|k| k.id), Some(e.id));
        t.run_pending_tasks().await;
        assert_eq!(
            t.weighted_size(),
            u64::from(t.weight_of(&e)),
            "it still weighs"
        );
        // Past the retention: gone.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(t.get_kept_by_key(&[1; 32]).await.is_none());
        assert!(t.get_kept(e.id).await.is_none());
    }

    #[tokio::test]
    async fn kept_entries_count_in_their_pool() {
        let one =
            (entry_in("a/x", &"x".repeat(1000), 50).weight() + ITEM_OVERHEAD + RECORD_BYTES) as u64;
        let t = MemoryTier::new(
            one * 40,
            Duration::from_secs(60),
            Duration::from_secs(60),
            None,
        );
        t.set_shares(Some(shares(&[("a", one * 10)], one * 30)), 1);
        t.insert([1; 32], entry_in("a/x", &"x".repeat(1000), 50))
            .await;
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(t.pool_size("a/x"), Some(one), "recorded past its expiry");
        assert!(t.get_kept_by_key(&[1; 32]).await.is_some());
    }

    #[tokio::test]
    async fn bounded_by_bytes_with_eviction_hook() {
        let evicted = Arc::new(AtomicUsize::new(0));
        let ev = evicted.clone();
        let hook: EvictionHook = Arc::new(move |_, _, _| {
            ev.fetch_add(1, Ordering::SeqCst);
        });
        let one = (entry(&"x".repeat(1000), 60_000).weight() + ITEM_OVERHEAD) as u64;
        let t = MemoryTier::new(
            one * 10,
            Duration::from_secs(60),
            Duration::ZERO,
            Some(hook),
        );
        for i in 0..50u8 {
            t.insert([i; 32], entry(&"x".repeat(1000), 60_000)).await;
            t.run_pending_tasks().await;
        }
        t.run_pending_tasks().await;
        assert!(t.weighted_size() <= one * 10, "{}", t.weighted_size());
        assert!(evicted.load(Ordering::SeqCst) >= 40);
    }

    /// A full tier makes room for a new answer by evicting the least recently used, never by
    /// turning the new one away (moka's default admission refuses a newcomer no more often
    /// read than the entry it would evict: every new answer, in a tier of answers never
    /// read again).
    #[tokio::test]
    async fn a_full_tier_keeps_the_newest_answers() {
        let one = (entry(&"x".repeat(1000), 60_000).weight() + ITEM_OVERHEAD) as u64;
        let t = MemoryTier::new(one * 10, Duration::from_secs(60), Duration::ZERO, None);
        let mut ids = Vec::new();
        for i in 0..50u8 {
            let e = entry(&"x".repeat(1000), 60_000);
            ids.push(e.id);
            t.insert([i; 32], e).await;
            t.run_pending_tasks().await;
        }
        for (i, id) in ids.iter().enumerate().skip(45) {
            assert!(t.get(*id).await.is_some(), "answer {i} of 50 is held");
            assert!(t.get_by_key(&[i as u8; 32]).await.is_some(), "and its key");
        }
        assert!(t.get(ids[0]).await.is_none(), "the oldest went");
    }

    /// The pool of a namespace `pool/rest`.
    fn pool_of(namespace: &str) -> &str {
        namespace.split_once('/').map_or("", |(p, _)| p)
    }

    fn shares(pools: &[(&str, u64)], rest: u64) -> MemoryShares {
        MemoryShares {
            pool_of,
            pools: pools.iter().map(|(p, b)| (p.to_string(), *b)).collect(),
            rest,
        }
    }

    // Entries of 4 KB: a pool's keys get an eighth of its share, room for a few keys per entry.
    #[tokio::test]
    async fn a_pool_flooding_the_tier_evicts_only_its_own_entries() {
        let one = (entry_in("a/x", &"x".repeat(4000), 60_000).weight()
            + ITEM_OVERHEAD
            + RECORD_BYTES) as u64;
        // Entries its pool pushes out are evictions to whoever counts them.
        let evicted = Arc::new(AtomicUsize::new(0));
        let ev = evicted.clone();
        let hook: EvictionHook = Arc::new(move |_, _, cause: RemovalCause| {
            if cause.was_evicted() {
                ev.fetch_add(1, Ordering::SeqCst);
            }
        });
        let t = MemoryTier::new(
            one * 40,
            Duration::from_secs(60),
            Duration::ZERO,
            Some(hook),
        );
        t.set_shares(
            Some(shares(&[("a", one * 10), ("b", one * 10)], one * 20)),
            1,
        );
        let b: Vec<_> = (0..8u8)
            .map(|_| entry_in("b/x", &"y".repeat(4000), 60_000))
            .collect();
        for (i, e) in b.iter().enumerate() {
            t.insert([100 + i as u8; 32], e.clone()).await;
        }
        let c = entry_in("c/x", &"z".repeat(4000), 60_000);
        t.insert([200; 32], c.clone()).await;
        // Pool a floods: 50 entries, five times its share, and aliases for each.
        let mut a = Vec::new();
        for i in 0..50u8 {
            let e = entry_in("a/x", &"x".repeat(4000), 60_000);
            t.insert([i; 32], e.clone()).await;
            t.alias(
                [
                    i, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                    1, 1, 1, 1, 1, 1,
                ],
                e.id,
            )
            .await;
            a.push(e);
        }
        t.run_pending_tasks().await;
        for (i, e) in b.iter().enumerate() {
            assert_eq!(
                t.get_by_key(&[100 + i as u8; 32]).await.map(|e| e.id),
                Some(e.id)
            );
        }
        assert_eq!(t.get_by_key(&[200; 32]).await.map(|e| e.id), Some(c.id));
        // a holds at most its share, and its newest entries.
        assert!(t.pool_size("a/x").unwrap() <= one * 10);
        let held = a.iter().filter(|e| t.entries.contains_key(&e.id)).count();
        assert!((1..=10).contains(&held), "{held}");
        assert_eq!(evicted.load(Ordering::SeqCst), 50 - held);
        assert!(t.get_by_key(&[49; 32]).await.is_some());
        assert!(t.get_by_key(&[0; 32]).await.is_none());
    }

    #[tokio::test]
    async fn shares_apply_to_what_is_held_and_can_be_lifted() {
        let one = (entry_in("a/x", &"x".repeat(1000), 60_000).weight()
            + ITEM_OVERHEAD
            + RECORD_BYTES) as u64;
        let t = MemoryTier::new(one * 40, Duration::from_secs(60), Duration::ZERO, None);
        for i in 0..20u8 {
            t.insert([i; 32], entry_in("a/x", &"x".repeat(1000), 60_000))
                .await;
        }
        t.run_pending_tasks().await;
        assert_eq!(t.entry_count(), 20);
        assert_eq!(t.pool_size("a/x"), None);
        // A share smaller than what pool a holds: the excess leaves.
        t.set_shares(Some(shares(&[("a", one * 5)], one * 35)), 1);
        t.run_pending_tasks().await;
        assert!((1..=5).contains(&t.entry_count()), "{}", t.entry_count());
        assert!(t.pool_size("a/x").unwrap() <= one * 5);
        // Lifted: pool a fills the whole tier again.
        // An older version changes nothing; a newer one lifts them.
        t.set_shares(None, 0);
        assert!(t.pool_size("a/x").is_some());
        t.set_shares(None, 2);
        for i in 0..20u8 {
            t.insert([50 + i; 32], entry_in("a/x", &"x".repeat(1000), 60_000))
                .await;
        }
        t.run_pending_tasks().await;
        assert!(t.entry_count() >= 20, "{}", t.entry_count());
    }

    #[tokio::test]
    async fn a_removed_entry_leaves_its_pool() {
        let one = (entry_in("a/x", &"x".repeat(1000), 60_000).weight()
            + ITEM_OVERHEAD
            + RECORD_BYTES) as u64;
        let t = MemoryTier::new(one * 40, Duration::from_secs(60), Duration::ZERO, None);
        t.set_shares(Some(shares(&[("a", one * 10)], one * 30)), 1);
        let e = entry_in("a/x", &"x".repeat(1000), 60_000);
        t.insert([1; 32], e.clone()).await;
        assert_eq!(t.pool_size("a/x"), Some(one));
        t.remove(e.id).await;
        t.run_pending_tasks().await;
        assert_eq!(t.pool_size("a/x"), Some(0));
        // Nothing bigger than the share itself enters.
        let huge = entry_in("a/x", &"x".repeat(40_000), 60_000);
        t.insert([2; 32], huge).await;
        assert!(t.get_by_key(&[2; 32]).await.is_none());
    }
}
