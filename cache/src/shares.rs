//! Shares of the memory tier's byte budget: one pool (a tenant) flooding the tier evicts
//! its own entries, never another pool's.
//!
//! The tier keeps one entry cache and one key cache (lookups by id and by key stay one hash
//! probe whatever the pools). With shares set, every entry and key is also recorded in its
//! pool's *ledger*: a small moka cache of ids (and of keys) weighed like the tier's, bounded
//! by the pool's share and evicting least recently used first. What a ledger evicts, the tier
//! drops. Entries are recorded in their ledger (and the ledger's evictions carried out)
//! before they enter the tier, so the tier itself never needs to evict for size: the shares
//! add up to at most its budget.
//!
//! Ledgers hold ids and weights, never the entries, so a stale record costs bytes of
//! accounting only until it is evicted or expires. A record weighs its entry (or key) plus
//! itself, so a pool's share bounds its entries and their accounting together.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use parking_lot::Mutex;

use crate::entry::{now_ms, Digest, Entry, EntryId};

/// What a ledger's record of an entry or a key costs: an item of the ledger's moka cache (its
/// bookkeeping, as [`crate::ITEM_OVERHEAD`] counts a tier's item), the id or key and the record.
pub const RECORD_BYTES: u32 = crate::memory::ITEM_OVERHEAD;

/// The pools of a tier and their budgets.
#[derive(Clone)]
pub struct MemoryShares {
    /// The pool of an entry's namespace (e.g. its tenant).
    pub pool_of: fn(&str) -> &str,
    /// Bytes of entries each named pool may hold.
    pub pools: HashMap<String, u64>,
    /// Bytes of entries shared by every pool not named.
    pub rest: u64,
}

impl std::fmt::Debug for MemoryShares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryShares")
            .field("pools", &self.pools)
            .field("rest", &self.rest)
            .finish()
    }
}

/// What a ledger evicted, for the tier to drop.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Evicted {
    Entry(EntryId),
    Key(Digest),
}

/// Evictions waiting to be carried out in the tier.
pub(crate) type EvictedQueue = Arc<Mutex<Vec<Evicted>>>;

/// An entry's record: its weight and when the tier drops it (its expiry plus the retention of
/// expired entries).
#[derive(Clone, Copy)]
struct Record {
    weight: u32,
    expires_ms: u64,
}

struct RecordExpiry;

impl moka::Expiry<EntryId, Record> for RecordExpiry {
    fn expire_after_create(&self, _: &EntryId, r: &Record, _: Instant) -> Option<Duration> {
        Some(Duration::from_millis(r.expires_ms.saturating_sub(now_ms())))
    }

    fn expire_after_update(
        &self,
        _: &EntryId,
        r: &Record,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(Duration::from_millis(r.expires_ms.saturating_sub(now_ms())))
    }
}

/// One pool's accounting.
pub(crate) struct Ledger {
    entries: Cache<EntryId, Record>,
    keys: Cache<Digest, ()>,
    /// How long the tier holds expired entries past their expiry (milliseconds): their
    /// records last as long, so kept entries still count in the pool.
    retain_ms: u64,
}

impl Ledger {
    fn new(
        bytes: u64,
        key_weight: u32,
        key_ttl: Duration,
        retain_ms: u64,
        evicted: &EvictedQueue,
    ) -> Ledger {
        let q = evicted.clone();
        let entries = Cache::builder()
            .max_capacity(bytes)
            .eviction_policy(EvictionPolicy::lru())
            .weigher(|_: &EntryId, r: &Record| r.weight)
            .expire_after(RecordExpiry)
            .eviction_listener(move |id: Arc<EntryId>, _, cause| {
                if cause == RemovalCause::Size {
                    q.lock().push(Evicted::Entry(*id));
                }
            })
            .build();
        let q = evicted.clone();
        // A key weighs what it costs the tier plus its record here.
        let key_weight = key_weight.saturating_add(RECORD_BYTES);
        let keys = Cache::builder()
            .max_capacity((bytes / 8).max(u64::from(key_weight)))
            .eviction_policy(EvictionPolicy::lru())
            .weigher(move |_: &Digest, _: &()| key_weight)
            .time_to_live(key_ttl)
            .eviction_listener(move |k: Arc<Digest>, _, cause| {
                if cause == RemovalCause::Size {
                    q.lock().push(Evicted::Key(*k));
                }
            })
            .build();
        Ledger {
            entries,
            keys,
            retain_ms,
        }
    }

    /// Records an entry weighing `weight` in the tier and settles the ledger; whether it was
    /// kept (an entry larger than the whole share is not). The record weighs the entry plus
    /// itself ([`RECORD_BYTES`]): the share bounds what the pool holds, its accounting included.
    pub(crate) fn record_entry(&self, entry: &Entry, weight: u32) -> bool {
        let record = Record {
            weight: weight.saturating_add(RECORD_BYTES),
            expires_ms: entry.expires_ms.saturating_add(self.retain_ms),
        };
        self.entries.insert(entry.id, record);
        self.entries.run_pending_tasks();
        self.entries.contains_key(&entry.id)
    }

    /// Records a key and settles the ledger.
    pub(crate) fn record_key(&self, key: Digest) {
        self.keys.insert(key, ());
        self.keys.run_pending_tasks();
    }

    /// Whether entry `id` is recorded.
    pub(crate) fn holds(&self, id: EntryId) -> bool {
        self.entries.contains_key(&id)
    }

    /// A read of the entry: it becomes the pool's most recently used.
    pub(crate) fn touch(&self, id: EntryId) {
        self.entries.get(&id);
    }

    /// The entry left the tier.
    pub(crate) fn forget(&self, id: EntryId) {
        self.entries.invalidate(&id);
    }

    /// Bytes recorded (after pending work).
    pub(crate) fn weighted_size(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.weighted_size()
    }
}

/// The ledgers of a set of shares.
pub(crate) struct Ledgers {
    pool_of: fn(&str) -> &str,
    named: HashMap<String, Ledger>,
    rest: Ledger,
}

impl Ledgers {
    pub(crate) fn new(
        shares: &MemoryShares,
        key_weight: u32,
        key_ttl: Duration,
        retain_ms: u64,
        evicted: &EvictedQueue,
    ) -> Ledgers {
        Ledgers {
            pool_of: shares.pool_of,
            named: shares
                .pools
                .iter()
                .map(|(name, bytes)| {
                    let ledger = Ledger::new(*bytes, key_weight, key_ttl, retain_ms, evicted);
                    (name.clone(), ledger)
                })
                .collect(),
            rest: Ledger::new(shares.rest, key_weight, key_ttl, retain_ms, evicted),
        }
    }

    /// The ledger of a namespace's pool.
    pub(crate) fn of(&self, namespace: &str) -> &Ledger {
        self.named
            .get((self.pool_of)(namespace))
            .unwrap_or(&self.rest)
    }

    /// Bytes recorded in the pool of `namespace`.
    pub(crate) fn pool_size(&self, namespace: &str) -> u64 {
        self.of(namespace).weighted_size()
    }
}
