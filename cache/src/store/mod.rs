//! One door to the tiers: the in-process memory tier (L1), the shared Redis tier (L2, when
//! configured) and the semantic index (when the semantic tier is on).
//!
//! Everything above the cache crate (the request path, background generation, prefetch,
//! replication, snapshots, the admin API) reaches entries only through a [`Store`], so each
//! rule that spans tiers is written once:
//!
//! - a key lookup asks memory, then Redis; an L2 hit is *promoted* (installed in memory and
//!   the index, and its key aliased in memory), so the next lookup is an L1 hit;
//! - an entry that leaves memory is tombstoned in the index (it could no longer be served);
//! - a candidate the index returns but memory no longer holds is fetched from Redis, or its
//!   vector is tombstoned;
//! - an alias points a key at an entry in memory and, queued, in Redis;
//! - writes to Redis are queued (never awaited on the request path); deletes go through the
//!   same queue, so an older pending put cannot resurrect a deleted entry;
//! - a deletion wins over a late promotion: an entry removed from this replica is remembered
//!   for a while ([`DELETED_TTL`]), and a copy read from Redis before the deletion (a
//!   promotion, a replicated put, a rebuild's page) is not installed again;
//! - expired entries are kept for the stale windows (`retain`, RFC 5861) in memory and Redis
//!   but are never fresh: only [`Store::find`] hands one out, as [`ByKey::Expired`], and
//!   nothing installs, promotes, loads or indexes one.

use std::borrow::Borrow;
use std::sync::Arc;
use std::time::Duration;

use moka::notification::RemovalCause;

use crate::entry::{Digest, Entry, EntryId, Merged};
use crate::memory::{EvictionHook, IndexCharge, MemoryTier};
use crate::redis::{RedisError, RedisTier, Updated};
use crate::semantic::{Candidate, MaintainReport, SemanticIndex};
use crate::shares::MemoryShares;
use crate::vector::Vector;

mod fence;
mod load;
mod removal;

use fence::Fences;
pub use fence::{DeleteFilter, FENCE_TTL};
pub use load::Loaded;

/// How long a deletion is remembered, so that a read of Redis that started before it cannot
/// put the entry back into memory, and an answer still generating when its id was deleted
/// is not stored (as long as a fence, and Redis's own mark of a deleted id).
pub const DELETED_TTL: Duration = fence::FENCE_TTL;

/// How often a failed Redis delete of an entry refused past its room, or a failed update of
/// a changed copy (a refusal added), is tried again.
const DELETE_RETRY: Duration = Duration::from_secs(2);

/// Most changed copies tried again at once (each holds its entry); past it a failed update
/// is dropped with a warning, as before the retries.
const MAX_PENDING_UPDATES: usize = 1024;
/// The bytes remembering deletions may take, on top of a memory budget of `memory_bytes`:
/// a thirty-second of it, and room for at least 1,024 ids. Each id weighs
/// [`ITEM_OVERHEAD`](crate::ITEM_OVERHEAD) (moka's bookkeeping dwarfs the 16-byte id); the
/// oldest are forgotten first. A namespace or tag delete is fenced besides (see
/// [`FENCE_TTL`]), so forgetting its ids early lets none of them back.
pub fn deleted_budget(memory_bytes: u64) -> u64 {
    (memory_bytes / 32).max(1024 * u64::from(crate::ITEM_OVERHEAD))
}

/// What a key leads to, judged by the caller's freshness rule.
#[derive(Debug)]
pub enum ByKey {
    /// An entry fresh enough for the caller.
    Fresh(Arc<Entry>),
    /// Only an entry too old for the caller (in memory, in Redis, or both).
    Stale,
    /// Only an expired entry, still kept to be served stale (not judged by the caller's
    /// freshness rule; of two, the later to expire).
    Expired(Arc<Entry>),
    /// Nothing.
    Absent,
}

impl ByKey {
    /// The fresh entry, if any.
    pub fn fresh(self) -> Option<Arc<Entry>> {
        match self {
            ByKey::Fresh(e) => Some(e),
            _ => None,
        }
    }
}

/// Which tiers a key lookup asked and whether each served it (for the lookup metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Probe {
    /// Memory served a fresh entry.
    pub memory: bool,
    /// Redis was asked (memory had nothing fresh) and served a fresh entry.
    pub redis: Option<bool>,
}

/// A key's expired entry, in memory or Redis, kept to be served stale.
#[derive(Default)]
struct Expired(Option<Arc<Entry>>);

impl Expired {
    /// Keeps `e` when it expires later than the one kept.
    fn offer(&mut self, e: Arc<Entry>) {
        if self.0.as_ref().is_none_or(|k| k.expires_ms < e.expires_ms) {
            self.0 = Some(e);
        }
    }
}

/// The cache's tiers behind one type. Cloning is cheap (handles to the same tiers).
#[derive(Clone)]
pub struct Store {
    memory: MemoryTier,
    redis: Option<RedisTier>,
    index: Option<Arc<SemanticIndex>>,
    /// Ids removed from this replica lately (see [`DELETED_TTL`]).
    deleted: moka::sync::Cache<EntryId, ()>,
    /// Namespaces and tags deleted lately, with when (ms; see [`FENCE_TTL`]).
    fences: Fences,
    /// How long expired entries are kept past their expiry, to be served stale.
    retain: Duration,
    /// Changed copies whose Redis update failed, being tried again (at most
    /// [`MAX_PENDING_UPDATES`]).
    pending_updates: Arc<std::sync::atomic::AtomicUsize>,
}

impl Store {
    /// A store over a new memory tier of `memory_bytes` (keys kept at most `key_ttl`), the
    /// given Redis tier and index. Expired entries are kept `retain` past their expiry in
    /// memory and Redis (the longest stale window; zero: dropped at expiry). `on_evict` is
    /// told of every entry that leaves memory for another reason than being replaced (after
    /// its vector was tombstoned).
    pub fn new(
        memory_bytes: u64,
        key_ttl: Duration,
        retain: Duration,
        redis: Option<RedisTier>,
        index: Option<Arc<SemanticIndex>>,
        on_evict: Option<Arc<dyn Fn(RemovalCause) + Send + Sync>>,
    ) -> Store {
        let charge = index.as_ref().map(|i| IndexCharge {
            dim: i.dim(),
            bytes: i.charge(),
        });
        let tombstone = index.clone();
        // Keep the index in step with memory: an entry that leaves memory can no longer be
        // served, so its vector is tombstoned.
        let hook: EvictionHook = Arc::new(move |id, _entry, cause| {
            if let Some(index) = &tombstone {
                index.remove(id);
            }
            if let Some(f) = &on_evict {
                f(cause);
            }
        });
        if let Some(r) = &redis {
            r.retain_expired(retain);
        }
        Store {
            memory: MemoryTier::with_index_charge(
                memory_bytes,
                key_ttl,
                retain,
                Some(hook),
                charge,
            ),
            redis,
            index,
            // The oldest deletes are forgotten first (a newcomer, never read, is never
            // turned away).
            deleted: moka::sync::Cache::builder()
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .max_capacity(deleted_budget(memory_bytes))
                .weigher(|_: &EntryId, _: &()| crate::ITEM_OVERHEAD)
                .time_to_live(DELETED_TTL)
                .build(),
            fences: Fences::default(),
            retain,
            pending_updates: Arc::default(),
        }
    }

    /// How long expired entries are kept past their expiry, to be served stale.
    pub fn retention(&self) -> Duration {
        self.retain
    }

    /// Shares the memory budget out among pools (see [`crate::shares`]); `None`: one budget.
    /// Entries over their pool's new share leave memory with the next write or
    /// [`Store::run_pending_tasks`]. Scans memory (blocking): call it off the async workers
    /// when entries are held. Shares of a `version` older than those in force are ignored.
    pub fn set_memory_shares(&self, shares: Option<MemoryShares>, version: u64) {
        self.memory.set_shares(shares, version);
    }

    /// Bytes of entries held for the pool of `namespace` (`None` without shares).
    pub fn pool_size(&self, namespace: &str) -> Option<u64> {
        self.memory.pool_size(namespace)
    }

    /// The shared tier, when configured (health, replication events, named blobs).
    pub fn redis(&self) -> Option<&RedisTier> {
        self.redis.as_ref()
    }

    /// The semantic index, when the semantic tier is on.
    pub fn index(&self) -> Option<&Arc<SemanticIndex>> {
        self.index.as_ref()
    }

    // ---- reads ----

    /// The entry `key` leads to, in memory then in Redis, if `fresh` accepts it. A memory
    /// entry that is too old (or expired) may have been replaced by another replica, so Redis
    /// is asked then too. An entry found in Redis is promoted into memory and the index. With
    /// nothing fresh or too old, an expired entry still kept is returned as
    /// [`ByKey::Expired`] (not promoted: it is never fresh again).
    pub async fn find(&self, key: &Digest, fresh: impl Fn(&Entry) -> bool) -> (ByKey, Probe) {
        let mut probe = Probe::default();
        let mut expired = Expired::default();
        let held = match self.memory.get_kept_by_key(key).await {
            Some(e) if e.is_expired() => {
                expired.offer(e);
                None
            }
            Some(e) => {
                // A read of an unexpired entry, as `get_by_key` counts it.
                self.memory.touch(&e);
                Some(e)
            }
            None => None,
        };
        let (hit, stale) = sort(held, &fresh);
        if let Some(entry) = hit {
            probe.memory = true;
            return (ByKey::Fresh(entry), probe);
        }
        let miss = |stale: bool, expired: Expired| match (stale, expired.0) {
            (true, _) => ByKey::Stale,
            (false, Some(e)) => ByKey::Expired(e),
            (false, None) => ByKey::Absent,
        };
        let Some(redis) = &self.redis else {
            return (miss(stale, expired), probe);
        };
        // Boxed: reading Redis (and promoting) is a large future that a memory hit (the hot
        // path) should not carry.
        Box::pin(self.find_in_redis(redis, key, fresh, stale, expired, probe)).await
    }

    /// The Redis half of [`Store::find`], after memory had nothing fresh (`stale`: it had one
    /// too old; `expired`: the expired one it kept).
    async fn find_in_redis(
        &self,
        redis: &RedisTier,
        key: &Digest,
        fresh: impl Fn(&Entry) -> bool,
        stale: bool,
        mut expired: Expired,
        mut probe: Probe,
    ) -> (ByKey, Probe) {
        let miss = |stale: bool, expired: Expired| match (stale, expired.0) {
            (true, _) => ByKey::Stale,
            (false, Some(e)) => ByKey::Expired(e),
            (false, None) => ByKey::Absent,
        };
        let l2 = redis.get_by_key(key).await.ok().flatten();
        let l2 = match l2.filter(|e| !e.refuses_key(key)) {
            Some(e) if e.is_expired() => {
                if !self.gone(&e) {
                    expired.offer(Arc::new(e));
                }
                None
            }
            l2 => l2,
        };
        let (l2, l2_stale) = sort(l2, &fresh);
        probe.redis = Some(l2.is_some());
        let Some(l2) = l2 else {
            return (miss(stale || l2_stale, expired), probe);
        };
        // The copy promoted carries the refusals this replica holds; one Redis's copy lacks
        // (its update failed) still refuses the key.
        let Some(entry) = self.promote(l2).await.filter(|e| !e.refuses_key(key)) else {
            // Deleted while it was being read (the deletion wins), or refused here.
            probe.redis = Some(false);
            return (miss(stale, expired), probe);
        };
        self.memory.alias(*key, entry.id).await;
        (ByKey::Fresh(entry), probe)
    }

    /// The fresh entries several keys lead to, in the order of `keys`: memory first, then
    /// every key memory lacks from Redis in one batched read ([`RedisTier::get_many_by_key`]:
    /// two rounds, not two per key), promoted like [`Store::find`]'s. Redis failing reads as
    /// absent.
    pub async fn find_many(
        &self,
        keys: &[Digest],
        fresh: impl Fn(&Entry) -> bool,
    ) -> Vec<Option<Arc<Entry>>> {
        let mut out = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let (hit, _) = sort(self.memory.get_by_key(key).await, &fresh);
            if hit.is_none() {
                missing.push(i);
            }
            out.push(hit);
        }
        let Some(redis) = self.redis.as_ref().filter(|_| !missing.is_empty()) else {
            return out;
        };
        let asked: Vec<Digest> = missing.iter().map(|&i| keys[i]).collect();
        let Ok(found) = redis.get_many_by_key(&asked).await else {
            return out;
        };
        for (i, l2) in missing.into_iter().zip(found) {
            let usable = |e: &Entry| !e.refuses_key(&keys[i]) && !e.is_expired() && fresh(e);
            let Some(l2) = l2.filter(usable) else {
                continue;
            };
            // Deleted or fenced here, or refused here (see `find_in_redis`): not served, not
            // linked.
            let Some(entry) = self.promote(l2).await.filter(|e| !e.refuses_key(&keys[i])) else {
                continue;
            };
            self.memory.alias(keys[i], entry.id).await;
            out[i] = Some(entry);
        }
        out
    }

    /// An entry this replica holds in memory (a read: it becomes recently used).
    pub async fn get(&self, id: EntryId) -> Option<Arc<Entry>> {
        self.memory.get(id).await
    }

    /// Whether this replica holds entry `id` in memory now, expired or not. Not a read: its
    /// recency is untouched, so a bookkeeping scan does not keep entries nobody reads.
    pub fn holds(&self, id: EntryId) -> bool {
        self.memory.holds(id)
    }

    /// An entry held by any tier, expired ones kept for stale serving included: memory,
    /// else Redis (nothing promoted); an error when Redis cannot say. For the admin API.
    pub async fn get_kept(&self, id: EntryId) -> Result<Option<Arc<Entry>>, RedisError> {
        if let Some(e) = self.memory.get_kept(id).await {
            return Ok(Some(e));
        }
        let Some(redis) = self.redis.as_ref() else {
            return Ok(None);
        };
        let e = redis.get(id).await?;
        Ok(e.filter(|e| !self.was_deleted(e.id)).map(Arc::new))
    }

    /// An entry by id for serving a semantic candidate: memory, else Redis (promoted). Only
    /// when every tier answers that it does not hold it is its vector tombstoned, so it is not
    /// found again; a Redis that cannot answer (down, slow, breaker open) leaves the vector
    /// alone: the entry may well still be there. An expired entry (kept to be served stale
    /// by its exact key) is no candidate: its vector is tombstoned, as it is never fresh
    /// again.
    pub async fn fetch(&self, id: EntryId) -> Option<Arc<Entry>> {
        if let Some(e) = self.memory.get_kept(id).await {
            if e.is_expired() {
                self.tombstone(id);
                return None;
            }
            self.memory.touch(&e);
            return Some(e);
        }
        if let Some(redis) = &self.redis {
            match redis.get(id).await {
                Ok(Some(e)) if !e.is_expired() => return self.promote(e).await,
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        self.tombstone(id);
        None
    }

    /// The entry `key` leads to in this replica's memory (no Redis round trip).
    pub async fn get_by_key(&self, key: &Digest) -> Option<Arc<Entry>> {
        self.memory.get_by_key(key).await
    }

    /// The `k` indexed entries of `partition` most similar to `query`, best first (empty
    /// without an index).
    pub fn search(&self, partition: &Digest, query: &[f32], k: usize) -> Vec<Candidate> {
        match &self.index {
            Some(index) => index.search(partition, query, k),
            None => Vec::new(),
        }
    }

    // ---- writes ----

    /// Stores a new entry under `keys` (the first is its exact key): queued to Redis with
    /// its tags, then memory, then the index (when it has a partition and an embedding).
    /// Nothing is stored when its id was deleted, or its namespace or a tag fenced, since its
    /// generation started.
    pub async fn insert(&self, entry: Arc<Entry>, keys: &[Digest]) {
        if self.was_deleted(entry.id) || self.fenced(&entry) {
            // Deleted by its id, namespace or tag while it was being generated (the id is
            // announced with the answer): storing it now would bring it back everywhere.
            return;
        }
        if let Some(redis) = &self.redis {
            // Queued: Redis being slow or down never delays or fails the answer.
            redis.put_with_tags(&entry, keys, &entry.tags);
        }
        let id = entry.id;
        // Indexed only when memory holds it: a vector whose entry its pool's share refused
        // would sit in the index outside every budget.
        let held = match keys.split_first() {
            Some((first, rest)) => {
                let held = self.memory.insert(*first, entry.clone()).await;
                for k in rest.iter().filter(|_| held) {
                    self.memory.alias(*k, id).await;
                }
                held
            }
            None => self.memory.insert_entry(entry.clone()).await,
        };
        if held {
            self.index_entry(&entry);
        }
        // A delete that ran between the check above and the memory insert found nothing
        // to remove: look again, as a promotion does.
        self.undo_if_gone(&entry).await;
    }

    /// Whether the entry was deleted here lately, by its id, namespace or tag: a copy read
    /// before (an expired entry kept to answer stale) is not to be served.
    pub fn gone(&self, entry: &Entry) -> bool {
        self.was_deleted(entry.id) || self.fenced(entry)
    }

    /// After a memory insert: takes the entry out again when it was deleted meanwhile (a
    /// delete between a check and the insert found nothing to remove). Whether it stays.
    async fn undo_if_gone(&self, entry: &Entry) -> bool {
        if self.gone(entry) {
            self.remove_local(entry.id).await;
            return false;
        }
        true
    }

    /// Replaces the memory copy of an entry with one whose metadata changed (same id, same
    /// answer): its keys and vector stay. Only while memory still holds the entry, and
    /// keeping the refusals the held copy gained since `entry` was read: a copy read before
    /// a delete or a verdict never brings the entry back nor drops the refusal.
    pub async fn replace(&self, entry: Arc<Entry>) {
        self.put_back(entry).await;
    }

    /// Puts a changed copy of an entry memory holds back in its place, with the refusals the
    /// held copy has and it lacks; nothing when memory no longer holds the entry or it was
    /// deleted. The copy kept, if any.
    async fn put_back(&self, entry: Arc<Entry>) -> Option<Arc<Entry>> {
        let held = self.memory.get_kept(entry.id).await?;
        if self.gone(&entry) {
            return None;
        }
        let entry = self.merged_with(entry, &held).await?;
        self.memory.insert_entry(entry.clone()).await;
        self.undo_if_gone(&entry).await.then_some(entry)
    }

    /// Stores a changed copy of a held entry (same id and answer; say, a refusal added) here
    /// and in Redis, whose replicas then take it in place of theirs (see
    /// [`Store::install`]). Its keys and vector stay. An entry Redis no longer holds was
    /// deleted elsewhere (or expired or evicted there): it goes here too, since its keys
    /// would otherwise serve what a verdict or a delete meant to stop.
    pub async fn update(&self, entry: Arc<Entry>) {
        self.write_change(entry, true).await;
    }

    /// [`Store::update`] for a change that stops nothing (a first use recorded, refusals
    /// carried to a renewed answer): an entry Redis does not hold (a dropped put, an
    /// eviction there) stays here.
    pub async fn update_kept(&self, entry: Arc<Entry>) {
        self.write_change(entry, false).await;
    }

    async fn write_change(&self, entry: Arc<Entry>, gone_goes: bool) {
        if self.was_deleted(entry.id) {
            // Deleted meanwhile: storing it again would bring it back everywhere.
            return;
        }
        // Refusals another replica gave the held copy meanwhile are kept.
        let entry = match self.memory.get(entry.id).await {
            Some(held) => match self.merged_with(entry, &held).await {
                Some(merged) => merged,
                None => return,
            },
            None => entry,
        };
        if let Some(redis) = &self.redis {
            // Only over the entry Redis still holds (one another replica deleted meanwhile,
            // its event not read here yet, stays deleted), merged with the refusals it has.
            match redis.update(&entry).await {
                Ok(Updated::Written | Updated::NotWritten) => {}
                // Gone from Redis: deleted elsewhere (or expired, or evicted there). Put back
                // here, its keys would serve it again; it goes here too.
                Ok(Updated::Gone) if gone_goes => {
                    self.remove_local(entry.id).await;
                    return;
                }
                Ok(Updated::Gone) => {}
                // Redis's copy and this one refuse more questions than one copy keeps.
                Ok(Updated::Full) => return self.refused_too_often(entry.id).await,
                // A copy with refusals is tried again (a first use recorded alone is not
                // worth a place among them).
                Err(e) if !entry.refusals.is_empty() => {
                    tracing::warn!(error = %e, id = %entry.id, "redis: update not written; trying again");
                    self.retry_update(entry.id, entry.clone());
                }
                Err(e) => tracing::warn!(error = %e, id = %entry.id, "redis: update not written"),
            }
        }
        // Deleted here while Redis was asked (its delete event read meanwhile).
        if self.gone(&entry) {
            return;
        }
        // Refusals the held copy gained while Redis was asked are kept too.
        let entry = match self.memory.get_kept(entry.id).await {
            Some(held) => match self.merged_with(entry, &held).await {
                Some(merged) => merged,
                None => return,
            },
            None => entry,
        };
        self.memory.insert_entry(entry.clone()).await;
        self.undo_if_gone(&entry).await;
    }

    /// Tries a changed copy's Redis update again every [`DELETE_RETRY`], for as long as a
    /// deletion's mark lasts ([`DELETED_TTL`]): a refusal given while Redis was down reaches
    /// it (and through it the other replicas) once it is back. Each try writes the copy
    /// memory holds then (it may have gained refusals), merged with Redis's as any update;
    /// it stops once the entry is deleted or gone from Redis.
    fn retry_update(&self, id: EntryId, entry: Arc<Entry>) {
        use std::sync::atomic::Ordering;
        let Some(redis) = self.redis.clone() else {
            return;
        };
        if self.pending_updates.fetch_add(1, Ordering::Relaxed) >= MAX_PENDING_UPDATES {
            self.pending_updates.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!(%id, "redis: too many updates waiting to be tried again; this one dropped");
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            // The first try has just failed.
            tokio::time::sleep(DELETE_RETRY).await;
            let updated = until_redis_takes("update", || {
                let (store, redis, entry) = (store.clone(), redis.clone(), entry.clone());
                async move {
                    if store.was_deleted(id) {
                        return Ok(None);
                    }
                    let entry = store.memory.get_kept(id).await.unwrap_or(entry);
                    redis.update(&entry).await.map(Some)
                }
            })
            .await;
            if let Some(Some(Updated::Full)) = updated {
                store.refused_too_often(id).await;
            }
            store.pending_updates.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Points `key` at `entry`, in memory and (queued, for the entry's remaining lifetime)
    /// in Redis.
    pub async fn alias(&self, key: Digest, entry: &Entry) {
        self.memory.alias(key, entry.id).await;
        if let Some(redis) = &self.redis {
            redis.alias(key, entry.id, entry.ttl_left());
        }
    }

    /// Like [`Store::alias`] for keys that do not lead to an entry yet: a key that already
    /// does is left alone (an answer generated for it is at least as good), here and in
    /// Redis (where another replica may hold one this replica does not).
    pub async fn alias_unclaimed(&self, keys: &[Digest], entry: &Entry) {
        for k in keys {
            if self.memory.get_by_key(k).await.is_none() {
                self.memory.alias(*k, entry.id).await;
                if let Some(redis) = &self.redis {
                    redis.alias_unclaimed(*k, entry.id, entry.ttl_left());
                }
            }
        }
    }

    /// Points every key that led to `old` at `new` (here and in Redis), so aliases do not
    /// turn into misses when `old` expires; `new` answers the same question afresh, so the
    /// questions `old` refused it refuses too (here and in Redis), and a key `old` refused is
    /// left behind. When the old entry cannot be read (gone from every tier, or Redis cannot
    /// answer), which keys it refused is unknown: none is repointed. Scans the keys off the
    /// async workers.
    pub async fn repoint(&self, old: EntryId, new: &Entry) {
        let memory = self.memory.clone();
        let Ok(keys) = tokio::task::spawn_blocking(move || memory.keys_of(old)).await else {
            return;
        };
        // Read even when no key is left to move (the renewed answer took its own already):
        // its refusals carry over all the same.
        let Ok(Some(previous)) = self.get_kept(old).await else {
            return;
        };
        let mut new = Arc::new(new.clone());
        if !previous.refusals.is_empty() {
            // A renewal that cannot refuse every question the old answer did goes, and no
            // key is moved to it.
            let Some(refusing) = self.merged_with(new.clone(), &previous).await else {
                return;
            };
            if !Arc::ptr_eq(&refusing, &new) {
                self.update_kept(refusing.clone()).await;
                new = refusing;
            }
        }
        for k in keys {
            if !previous.refuses_key(&k) {
                self.alias(k, &new).await;
            }
        }
    }

    /// Puts an entry that another replica wrote (or a snapshot held) into this replica's
    /// memory and index. One already held is returned as held and not re-indexed; refusals
    /// the incoming copy has and the held one lacks ([`Store::update`] on another replica)
    /// are merged into it. An expired entry is returned but not installed.
    /// An entry this replica deleted lately is not installed either (the deletion wins).
    pub async fn install(&self, entry: Entry) -> Arc<Entry> {
        if let Some(held) = self.memory.get(entry.id).await {
            return self.merge_refusals(held, &entry).await;
        }
        let entry = Arc::new(entry);
        if entry.is_expired() || self.gone(&entry) {
            return entry;
        }
        if self.memory.insert_entry(entry.clone()).await && self.undo_if_gone(&entry).await {
            self.index_entry(&entry);
        }
        entry
    }

    /// An entry read from Redis for a lookup, installed here; `None` when this replica
    /// deleted it meanwhile (the read started before the deletion reached it).
    async fn promote(&self, entry: Entry) -> Option<Arc<Entry>> {
        if self.gone(&entry) {
            return None;
        }
        let entry = self.install(entry).await;
        // A deletion between the check and the insertion removed it from memory after it
        // was put there, or before: look again so that it is not served either way.
        self.undo_if_gone(&entry).await.then_some(entry)
    }

    /// Whether this replica removed the entry within [`DELETED_TTL`].
    pub fn was_deleted(&self, id: EntryId) -> bool {
        self.deleted.contains_key(&id)
    }

    /// `entry` with `other`'s refusals it lacks (`entry` itself when it lacks none). `None`
    /// when the two together refuse more questions than one copy keeps: the entry is then
    /// deleted ([`Store::refused_too_often`]).
    async fn merged_with(&self, entry: Arc<Entry>, other: &Entry) -> Option<Arc<Entry>> {
        let mut merged = (*entry).clone();
        match merged.merge_refusals(other) {
            Merged::Same => Some(entry),
            Merged::Added => Some(Arc::new(merged)),
            Merged::Full => {
                self.refused_too_often(entry.id).await;
                None
            }
        }
    }

    /// `held` with `incoming`'s refusals it lacks (stored in memory when there were any, and
    /// memory still holds it undeleted). When the two together refuse more questions than
    /// one copy keeps, the entry is deleted and `held` returned, gone.
    async fn merge_refusals(&self, held: Arc<Entry>, incoming: &Entry) -> Arc<Entry> {
        match self.merged_with(held.clone(), incoming).await {
            Some(merged) if !Arc::ptr_eq(&merged, &held) => {
                self.put_back(merged.clone()).await;
                merged
            }
            _ => held,
        }
    }

    /// Deletes an entry whose copies refuse more questions than one copy keeps, here and
    /// everywhere: keeping it would drop some refusal, and serve a question reported wrong
    /// again (fail closed, as a wrong verdict on a full entry does). Its own question is
    /// answered afresh.
    ///
    /// Gone here at once; Redis's delete (which tells the other replicas) is queued behind
    /// the writes before it and not waited for, since this runs inside replication and
    /// lookups; one that fails (Redis down) is tried again every [`DELETE_RETRY`] for as long
    /// as this replica's mark of the deletion lasts ([`DELETED_TTL`]), so a Redis that comes
    /// back holding the entry loses it too.
    pub async fn refused_too_often(&self, id: EntryId) {
        tracing::info!(%id, "an entry refused more questions than it can keep: deleted");
        self.remove_local(id).await;
        let Some(redis) = self.redis.clone() else {
            return;
        };
        tokio::spawn(async move {
            until_redis_takes("delete", || {
                let redis = redis.clone();
                async move { redis.delete(id).await }
            })
            .await;
        });
    }

    /// Rebuilds index partitions that collected many tombstones (blocking: call it from
    /// `spawn_blocking`). `None` without an index.
    pub fn maintain(&self) -> Option<MaintainReport> {
        self.index.as_ref().map(|i| i.maintain())
    }

    // ---- views ----

    /// A snapshot of the entries this replica holds, expired ones kept for stale serving
    /// included (`Entry::is_expired` tells them apart).
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.memory.iter_entries()
    }

    /// A snapshot of this replica's exact keys and aliases.
    pub fn keys(&self) -> Vec<(Digest, EntryId)> {
        self.memory.iter_keys()
    }

    /// Entries held in memory (approximate until pending work runs).
    pub fn entry_count(&self) -> u64 {
        self.memory.entry_count()
    }

    /// Bytes held in memory (approximate until pending work runs).
    pub fn weighted_size(&self) -> u64 {
        self.memory.weighted_size()
    }

    /// Vectors live in the index (0 without one).
    pub fn indexed(&self) -> usize {
        self.index.as_ref().map_or(0, |i| i.len())
    }

    /// Runs the memory tier's pending maintenance (evictions, expiry notifications) now.
    pub async fn run_pending_tasks(&self) {
        self.memory.run_pending_tasks().await;
    }

    // ---- helpers ----

    /// The entry's vector when it belongs in the index: an index exists, the vector has its
    /// size and was made by the index's embedder, the entry has a real partition, and it is
    /// not indexed yet. (An entry whose vector another model made, written by a replica on
    /// that model or kept in a snapshot from before a change of model, still answers by its
    /// exact keys.)
    fn indexable(&self, entry: &Entry) -> Option<Vector> {
        let index = self.index.as_ref()?;
        let v = entry.embedding.as_ref()?;
        (v.len() == index.dim()
            && index.takes(entry.embedder.as_ref())
            && entry.partition != [0; 32]
            && !index.contains(entry.id))
        .then(|| v.clone())
    }

    /// Indexes a held entry's vector. Memory may evict the entry between its insert and this
    /// (another write's housekeeping); its eviction hook then found nothing to remove, so the
    /// vector would stay in the index outside every budget: it is taken out again here. An
    /// eviction after the check finds the vector and removes it itself.
    fn index_entry(&self, entry: &Entry) {
        if let (Some(index), Some(v)) = (&self.index, self.indexable(entry)) {
            index.insert(entry.partition, entry.id, v);
            if !self.memory.holds(entry.id) {
                index.remove(entry.id);
            }
        }
    }
}

/// Splits what a tier returned into an entry `fresh` accepts and whether an older one was
/// there.
fn sort<E: Borrow<Entry>>(found: Option<E>, fresh: impl Fn(&Entry) -> bool) -> (Option<E>, bool) {
    match found {
        Some(e) if fresh(e.borrow()) => (Some(e), false),
        Some(_) => (None, true),
        None => (None, false),
    }
}

/// Runs `attempt` until Redis takes it, trying again every [`DELETE_RETRY`] for as long as a
/// deletion's mark lasts ([`DELETED_TTL`]); `None` when it never did.
async fn until_redis_takes<T, F, Fut>(what: &str, mut attempt: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, RedisError>>,
{
    let since = tokio::time::Instant::now();
    loop {
        match attempt().await {
            Ok(done) => return Some(done),
            Err(e) if since.elapsed() + DELETE_RETRY < DELETED_TTL => {
                tracing::debug!(error = %e, what, "redis: not taken yet; trying again");
                tokio::time::sleep(DELETE_RETRY).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, what, "redis: not taken, given up");
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests;
