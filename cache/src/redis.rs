//! The Redis tier (L2): one cache shared by every reprise replica, surviving their restarts.
//!
//! Redis is an optimisation, never a dependency of a request: every command is bounded by
//! `timeout_ms` and goes through a circuit breaker, writes are queued and applied by a
//! background task (a full queue or an open breaker drops them, counted), and the tier can be
//! created while Redis is down. It comes back by itself when Redis does.
//!
//! # Data model
//!
//! | key                        | value                                   | expiry          |
//! |----------------------------|-----------------------------------------|-----------------|
//! | `{prefix}:e:{<id>}`        | `{"v":1,"entry":{...}}` (JSON envelope) | entry's own +   |
//! | `{prefix}:k:<hex digest>`  | entry id (32 hex chars)                 | entry's / alias |
//! | `{prefix}:d:{<id>}`        | `1`: the entry was deleted              | 15 minutes      |
//! | `{prefix}:ns:{<ns>}`       | sorted set of ids, score = kept until   | none (swept)    |
//! | `{prefix}:tag:{<tag>}`     | sorted set of ids, score = kept until   | none (swept)    |
//! | `{prefix}:tagfence:{<tag>}`| hash: namespace prefix → fence's end    | its last fence  |
//! | `{prefix}:events`          | stream of `op`, `id`, `ns`, `origin`    | `MAXLEN ~`      |
//! | `{prefix}:policies`        | hash: `version`, `doc`, `origin`        | none            |
//! | `{prefix}:blob:{<name>}`   | a component's value (`put_blob`)        | none or given   |
//! | `{prefix}:hash:{<name>}`   | hash of values by field (`put_field`)   | given, renewed  |
//! | `{prefix}:sweep`           | the replica sweeping the index sets     | the interval    |
//!
//! `+`: entries, their keys and their index entries are kept past the entry's expiry for the
//! retention of expired entries ([`RedisTier::retain_expired`], the longest stale window;
//! zero by default), so that a replica can still serve them stale (RFC 5861). The reads
//! return such an expired entry like any other; callers tell them apart by
//! `Entry::is_expired` (the [`crate::Store`] never treats one as fresh). Namespace and tag
//! deletes reach kept entries too, since their index entries last as long.
//!
//! Deletes fence what was generated before them, so a put another replica had queued (or an
//! answer it generated across the delete) does not bring a deleted answer back: a deleted id
//! is marked (`d:`), a deleted namespace or tag gets a member `fence` in its index set, scored
//! with when the fence ends (so the sets' pruning drops it then); the put scripts refuse an
//! entry so marked, or one whose generation started before a fence of one of its sets.
//!
//! A policy event carries `version` instead of `id` and `ns`. The policy document is the
//! server's (JSON); the tier only keeps its version rule (see `policies.rs`).
//!
//! Keys that hold one thing carry that thing in a hash tag (`{<id>}`, `{<ns>}`): on a cluster
//! the slot then depends on the id or name alone, so any companion key added later for the
//! same entry or namespace lands in the same slot and can be updated by one script. Entries
//! and their exact keys live in different slots on purpose (keys spread with their digest),
//! so a put is several independent commands rather than one transaction: a key whose entry
//! is missing is just a miss.
//!
//! Index sets are sorted by expiry so that each put can prune the ids that have expired
//! (`ZREMRANGEBYSCORE`) and an index never grows without bound while its namespace is busy.
//! They carry no TTL, so a `volatile-*` eviction policy never evicts one before the entries
//! it lists (a namespace or tag delete would miss those); a sweep every [`SWEEP_INTERVAL`]
//! ([`sweep`]) prunes every set and deletes the empty ones.
//!
//! A value that does not decode (corrupt, written by something else under the prefix, or a
//! future envelope version) is skipped: the read is a miss, `reprise_redis_skipped_total`
//! counts it.

mod batch;
mod breaker;
mod config;
mod conn;
mod envelope;
mod error;
mod events;
mod keys;
mod metrics;
mod policies;
mod put;
mod shared;
mod sweep;
mod writer;

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::redis::Value;
use parking_lot::RwLock;
use tokio::sync::mpsc;

// `self::`: the `metrics` crate has the same name as the submodule.
use self::metrics::{Op, RedisMetrics};
use crate::entry::{now_ms, Digest, Entry, EntryId};
use breaker::Breaker;
use conn::Connector;
use envelope::{EnvelopeOut, ENVELOPE_VERSION};
use error::{first_outage, is_wrong_type};
use keys::Keys;
use shared::Shared;
use writer::{write_loop, Admin, Queued, Write};

pub use self::metrics::describe_metrics;
pub use config::RedisConfig;
pub use error::{RedisError, RedisHealth};
pub use events::{ReplicationEvent, ReplicationStream};
pub use policies::{PolicyPublish, SharedPolicies};
pub use sweep::{Swept, SWEEP_INTERVAL};

/// What [`RedisTier::update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updated {
    /// The changed copy replaced the one Redis held.
    Written,
    /// Redis holds no such entry (deleted, expired or evicted there).
    Gone,
    /// Redis holds it, and it was not replaced (over the size cap, not serialisable, or
    /// changed by others on every try).
    NotWritten,
    /// Redis's copy and the changed one together refuse more questions than one copy keeps
    /// ([`crate::entry::Merged::Full`]): not written; the entry is to be deleted.
    Full,
}

/// Keys asked for per SCAN call.
const SCAN_COUNT: usize = 500;
/// Most bytes of values read at once by a scan (a larger value is read alone): a page of
/// entries near `max_value_bytes` each would otherwise be hundreds of megabytes in flight.
const SCAN_PAGE_BYTES: u64 = 1 << 20;
/// Hashes read per round by [`RedisTier::get_fields`] (each round is bounded by the command
/// timeout).
pub const FIELDS_ROUND: usize = 32;

/// The fields of a hash whose values are at most `ARGV[1]` bytes, at most `ARGV[2]` of them,
/// as field, value, field, value...; a field whose value is longer comes with an empty value
/// (never sent). One key, so it runs on a cluster too.
const CAPPED_FIELDS: &str = "\
local out = {}
local n = 0
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if n >= tonumber(ARGV[2]) then break end
  n = n + 1
  out[#out + 1] = f
  if redis.call('HSTRLEN', KEYS[1], f) <= tonumber(ARGV[1]) then
    out[#out + 1] = redis.call('HGET', KEYS[1], f)
  else
    out[#out + 1] = ''
  end
end
return out";
/// Deletes each field `ARGV[2i-1]` of the hash whose value is still `ARGV[2i]`; returns how
/// many went.
const DEL_UNCHANGED_FIELDS: &str = "\
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n";
/// A scan logs its progress every this many entries.
const SCAN_LOG_EVERY: usize = 10_000;

/// The value an entry is stored as (its envelope, JSON).
pub(super) fn stored_value(entry: &Entry) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&EnvelopeOut {
        v: ENVELOPE_VERSION,
        entry,
    })
}

/// The Redis tier. Cheap to clone; the background writer stops once every clone is dropped
/// (after applying what was queued).
#[derive(Clone)]
pub struct RedisTier {
    shared: Arc<Shared>,
    writes: mpsc::Sender<Queued>,
}

impl fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTier")
            .field("prefix", &self.shared.keys.prefix)
            .field("replica_id", &self.shared.replica_id)
            .field("health", &self.health())
            .finish()
    }
}

impl RedisTier {
    /// Creates the tier without waiting for Redis: it connects on first use (a first attempt
    /// starts in the background now), so a Redis that is down at start only opens the
    /// breaker. `replica_id` names this replica in the events it publishes, so its own
    /// subscription can skip them. Must be called within a Tokio runtime.
    pub async fn connect(cfg: RedisConfig, replica_id: String) -> Result<RedisTier, RedisError> {
        if !cfg.is_enabled() {
            return Err(RedisError::Config(
                "neither url nor cluster_urls is set".into(),
            ));
        }
        let timeout = Duration::from_millis(cfg.timeout_ms.max(1));
        let connect_timeout = Duration::from_millis(cfg.connect_timeout_ms.max(1));
        let connector = Connector::new(
            cfg.url.as_deref(),
            &cfg.cluster_urls,
            connect_timeout,
            timeout,
        )
        .map_err(|e| RedisError::Config(e.to_string()))?;
        let conn = connector
            .connect(connect_timeout, timeout)
            .map_err(|e| RedisError::Config(e.to_string()))?;
        let metrics = RedisMetrics::new();
        metrics.breaker_open.set(0.0);
        let shared = Arc::new(Shared {
            keys: Keys { prefix: cfg.prefix },
            replica_id,
            timeout,
            connect_timeout,
            events_maxlen: cfg.events_maxlen.max(1),
            max_value_bytes: cfg.max_value_bytes.max(1),
            connector,
            conn: RwLock::new(conn),
            breaker: Breaker::new(
                cfg.breaker_failures,
                Duration::from_millis(cfg.breaker_cooldown_ms),
            ),
            metrics,
            dropped: AtomicU64::new(0),
            up: AtomicBool::new(false),
            rounds: AtomicU64::new(0),
            retain_ms: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            queue_bytes: cfg.write_queue_bytes.max(1),
        });
        let (writes, rx) = mpsc::channel(cfg.write_queue.max(1));
        tokio::spawn(write_loop(shared.clone(), rx));
        tokio::spawn(sweep::sweep_loop(Arc::downgrade(&shared)));
        // Dial now rather than on the first request, and set the `up` gauge early. The first
        // dial may take up to connect_timeout, longer than a command's bound, hence its own.
        let warm = shared.clone();
        tokio::spawn(async move {
            let conn = warm.conn.read().clone();
            let ping = ::redis::cmd("PING");
            let ok = matches!(
                tokio::time::timeout(warm.connect_timeout, conn.query::<Value>(&ping)).await,
                Ok(Ok(_))
            );
            if !ok {
                tracing::warn!("redis: not reachable at start; continuing without it");
            }
            warm.up.store(ok, Ordering::Relaxed);
            warm.metrics.up.set(if ok { 1.0 } else { 0.0 });
        });
        Ok(RedisTier { shared, writes })
    }

    /// The entry an exact key (or alias) points at.
    pub async fn get_by_key(&self, key: &Digest) -> Result<Option<Entry>, RedisError> {
        let name = self.shared.keys.key(key);
        // An id is 32 characters: a longer value is foreign, and is not read whole.
        let cmd = ::redis::cmd("GETRANGE").arg(&name).arg(0).arg(63).clone();
        let raw: Option<Vec<u8>> = match self
            .shared
            .run(Op::GetByKey, |c| async move { c.query(&cmd).await })
            .await
        {
            Ok(raw) => raw,
            Err(e) if is_wrong_type(&e) => {
                self.shared.skip(&name, "not a string");
                None
            }
            Err(e) => return Err(e),
        };
        let Some(raw) = raw.filter(|r| !r.is_empty()) else {
            return Ok(None);
        };
        let Some(id) = std::str::from_utf8(&raw)
            .ok()
            .and_then(|s| s.parse::<EntryId>().ok())
        else {
            self.shared.skip(&name, "not an entry id");
            return Ok(None);
        };
        self.shared.get(Op::GetByKey, id).await
    }

    /// Keeps entries written from now on (with their keys, aliases and index entries)
    /// `retain` past their expiry, and reads expired entries that are still within it, so
    /// that they can be served stale; zero (the default) drops them at expiry. Replicas
    /// sharing one Redis should keep the same retention.
    pub fn retain_expired(&self, retain: Duration) {
        let ms = u64::try_from(retain.as_millis()).unwrap_or(u64::MAX);
        self.shared.retain_ms.store(ms, Ordering::Relaxed);
    }

    /// The write queue's budget (`write_queue_bytes`): a larger write is always dropped.
    pub fn queue_budget(&self) -> u64 {
        self.shared.queue_bytes
    }

    /// Bytes of writes queued and not yet applied (at most `write_queue_bytes`).
    pub fn queued_bytes(&self) -> u64 {
        self.shared.queued_bytes.load(Ordering::Relaxed)
    }

    /// Operations this tier has sent to Redis (each one round trip: a command, or commands
    /// sent together), for observing how many round trips a piece of work costs.
    pub fn rounds(&self) -> u64 {
        self.shared.rounds.load(Ordering::Relaxed)
    }

    /// An entry by id.
    pub async fn get(&self, id: EntryId) -> Result<Option<Entry>, RedisError> {
        self.shared.get(Op::Get, id).await
    }

    /// Whether Redis holds each entry (its key exists), in one bounded round. Any outage fails
    /// the whole round: only a definite answer says an entry is absent.
    pub async fn exists_many(&self, ids: &[EntryId]) -> Result<Vec<bool>, RedisError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let cmds: Vec<::redis::Cmd> = ids
            .iter()
            .map(|id| {
                ::redis::cmd("EXISTS")
                    .arg(self.shared.keys.entry(*id))
                    .clone()
            })
            .collect();
        self.shared
            .run(Op::Get, |c| async move {
                let replies =
                    futures::future::try_join_all(cmds.iter().map(|cmd| c.query::<i64>(cmd)))
                        .await?;
                Ok(replies.into_iter().map(|n| n > 0).collect())
            })
            .await
    }

    /// Queues an entry and the exact keys pointing at it, all expiring with the entry.
    /// Returns at once: `false` when the write was dropped (queue full, breaker open,
    /// entry already expired, larger than `max_value_bytes`, which no reader would take).
    pub fn put(&self, entry: &Entry, keys: &[Digest]) -> bool {
        self.put_with_tags(entry, keys, &[])
    }

    /// Like [`RedisTier::put`], also adding the entry to the given tags' indexes so that
    /// [`RedisTier::delete_tag`] can invalidate it.
    pub fn put_with_tags(&self, entry: &Entry, keys: &[Digest], tags: &[String]) -> bool {
        if entry.is_expired() {
            return false;
        }
        let bytes = match stored_value(entry) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, id = %entry.id, "redis: entry not serialisable");
                return false;
            }
        };
        // No replica would read it (each skips a value over the cap): kept in this replica's
        // memory only, and counted as a dropped write.
        if bytes.len() > self.shared.max_value_bytes {
            tracing::debug!(id = %entry.id, bytes = bytes.len(), "redis: entry over max_value_bytes not written");
            self.shared.drop_write();
            return false;
        }
        self.enqueue(Write::Put {
            id: entry.id,
            namespace: entry.namespace.clone(),
            expires_ms: entry.expires_ms,
            started_ms: entry.created_ms.saturating_sub(u64::from(entry.gen_ms)),
            bytes,
            keys: keys.to_vec(),
            tags: tags.to_vec(),
        })
    }

    /// Whether `entry` is small enough to be written (within `max_value_bytes` as stored):
    /// a put of one that is not is refused, and counted as a dropped write.
    pub fn fits(&self, entry: &Entry) -> bool {
        stored_value(entry).is_ok_and(|b| b.len() <= self.shared.max_value_bytes)
    }

    /// Redis's epoch: a random value set once (`SET NX`) under a key that never expires, and
    /// read back. A different epoch than before means Redis lost its data meanwhile
    /// (restarted without persistence, flushed): what it does not hold was not deleted.
    pub async fn epoch(&self) -> Result<String, RedisError> {
        const EPOCH_SCRIPT: &str = "\
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])";
        let shared = &self.shared;
        let fresh = EntryId::random().to_string();
        let cmd = ::redis::cmd("EVAL")
            .arg(EPOCH_SCRIPT)
            .arg(1)
            .arg(shared.keys.epoch())
            .arg(fresh)
            .clone();
        shared
            .run(Op::Get, |c| async move { c.query::<String>(&cmd).await })
            .await
    }

    /// Writes a changed copy of an entry Redis holds (same id; a refusal added), after the
    /// writes queued before it: merged with the refusals of the copy Redis holds (another
    /// replica may have added one meanwhile: neither is lost) and swapped in only if that
    /// copy did not change meanwhile (read again if it did), keeping its lifetime; then a put
    /// event. Nothing is written when Redis does not hold the entry (deleted meanwhile: it
    /// stays so). Returns what became of it.
    pub async fn update(&self, entry: &Entry) -> Result<Updated, RedisError> {
        let entry = Box::new(entry.clone());
        self.admin(|reply| Admin::Update { entry, reply }).await
    }

    /// Queues another exact key pointing at an existing entry, for `ttl`. Returns `false`
    /// when dropped.
    pub fn alias(&self, key: Digest, id: EntryId, ttl: Duration) -> bool {
        self.alias_with(key, id, ttl, false)
    }

    /// Like [`RedisTier::alias`], only where `key` leads to no entry in Redis (another
    /// replica's answer for it stays; a key left by a deleted or expired entry is taken).
    pub fn alias_unclaimed(&self, key: Digest, id: EntryId, ttl: Duration) -> bool {
        self.alias_with(key, id, ttl, true)
    }

    fn alias_with(&self, key: Digest, id: EntryId, ttl: Duration, unclaimed: bool) -> bool {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ttl_ms == 0 {
            return false;
        }
        self.enqueue(Write::Alias {
            key,
            id,
            expires_ms: now_ms().saturating_add(ttl_ms),
            unclaimed,
        })
    }

    /// Queues a named value (e.g. learned state of a component) under the prefix, without
    /// expiry, replacing any earlier one. Returns `false` when the write was dropped.
    pub fn put_blob(&self, name: &str, bytes: Vec<u8>) -> bool {
        self.enqueue(Write::Blob {
            name: name.to_string(),
            bytes,
            ttl_ms: None,
        })
    }

    /// Like [`RedisTier::put_blob`], kept for `ttl` only.
    pub fn put_blob_for(&self, name: &str, bytes: Vec<u8>, ttl: Duration) -> bool {
        self.enqueue(Write::Blob {
            name: name.to_string(),
            bytes,
            ttl_ms: Some(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
        })
    }

    /// Queues one field of the named hash (e.g. one replica's part of a shared record),
    /// replacing that field, and keeps the hash for `ttl` from this write. Returns `false`
    /// when the write was dropped.
    pub fn put_field(&self, name: &str, field: &str, bytes: Vec<u8>, ttl: Duration) -> bool {
        self.enqueue(Write::Field {
            name: name.to_string(),
            field: field.to_string(),
            bytes,
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// The fields of each named hash written by [`RedisTier::put_field`] (absent: none), in
    /// the order of `names`, read [`FIELDS_ROUND`] hashes per round. At most `max_fields`
    /// fields of a hash are read; a value over `max_value_bytes` is never sent (skipped and
    /// counted), and a key that is not a hash reads as empty. Fails when a round fails.
    pub async fn get_fields(
        &self,
        names: &[String],
        max_fields: usize,
    ) -> Result<Vec<Vec<(String, Vec<u8>)>>, RedisError> {
        let mut out = Vec::with_capacity(names.len());
        for chunk in names.chunks(FIELDS_ROUND) {
            let keys: Vec<String> = chunk.iter().map(|n| self.shared.keys.hash(n)).collect();
            let replies = self
                .shared
                .run(Op::Get, |c| {
                    let keys = &keys;
                    async move {
                        let replies = futures::future::join_all(keys.iter().map(|key| {
                            let c = c.clone();
                            let cmd = ::redis::cmd("EVAL")
                                .arg(CAPPED_FIELDS)
                                .arg(1)
                                .arg(key)
                                .arg(self.shared.max_value_bytes)
                                .arg(max_fields)
                                .clone();
                            async move { c.query::<Vec<Vec<u8>>>(&cmd).await }
                        }))
                        .await;
                        first_outage(&replies)?;
                        Ok(replies)
                    }
                })
                .await?;
            for (key, reply) in keys.iter().zip(replies) {
                // Redis answered with an error for this key alone (not a hash).
                let Ok(flat) = reply else {
                    self.shared.skip(key, "not a hash");
                    out.push(Vec::new());
                    continue;
                };
                let mut fields = Vec::with_capacity(flat.len() / 2);
                let mut it = flat.into_iter();
                while let (Some(f), Some(v)) = (it.next(), it.next()) {
                    match String::from_utf8(f) {
                        Ok(f) if v.is_empty() => self.shared.skip(&f, "over max_value_bytes"),
                        Ok(f) => fields.push((f, v)),
                        Err(_) => self.shared.skip(key, "field not UTF-8"),
                    }
                }
                out.push(fields);
            }
        }
        Ok(out)
    }

    /// Takes the value stored under `name`: replaces it with `replacement` (keeping its
    /// lifetime) and returns what it was; nothing is written when there is none. Applied
    /// after the writes queued before it, so of callers racing for one value exactly one gets
    /// it as it was stored.
    pub async fn take_blob(
        &self,
        name: &str,
        replacement: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, RedisError> {
        let name = name.to_string();
        self.admin(|reply| Admin::TakeBlob {
            name,
            replacement,
            reply,
        })
        .await
    }

    /// Replaces the value stored under `name` with `marked` (keeping its lifetime) unless it
    /// is `spent`: `Some(true)` when replaced, `Some(false)` when it was `spent`, `None` when
    /// there is none. Applied after the writes queued before it, in one step against a racing
    /// [`RedisTier::take_blob`].
    pub async fn mark_blob(
        &self,
        name: &str,
        spent: Vec<u8>,
        marked: Vec<u8>,
    ) -> Result<Option<bool>, RedisError> {
        let name = name.to_string();
        self.admin(|reply| Admin::MarkBlob {
            name,
            spent,
            marked,
            reply,
        })
        .await
    }

    /// Removes each of `fields` from the named hash written by [`RedisTier::put_field`] (a
    /// writer gone for good: its field would only take room) if it still holds the value it
    /// was read with (one its writer wrote again since stays). Returns how many went.
    pub async fn del_fields(
        &self,
        name: &str,
        fields: &[(String, Vec<u8>)],
    ) -> Result<u64, RedisError> {
        if fields.is_empty() {
            return Ok(0);
        }
        let key = self.shared.keys.hash(name);
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(DEL_UNCHANGED_FIELDS).arg(1).arg(&key);
        for (field, value) in fields {
            cmd.arg(field).arg(value.as_slice());
        }
        self.shared
            .run(Op::Delete, |c| async move { c.query::<u64>(&cmd).await })
            .await
    }

    /// The value stored by [`RedisTier::put_blob`] under `name`, if any and at most
    /// `max_bytes` long (a longer one is absent: skipped and counted, never read).
    pub async fn get_blob(
        &self,
        name: &str,
        max_bytes: usize,
    ) -> Result<Option<Vec<u8>>, RedisError> {
        let key = self.shared.keys.blob(name);
        let cmd = ::redis::cmd("EVAL")
            .arg(shared::CAPPED_GET)
            .arg(1)
            .arg(&key)
            .arg(max_bytes)
            .clone();
        match self
            .shared
            .run(
                Op::Get,
                |c| async move { c.query::<shared::Capped>(&cmd).await },
            )
            .await
        {
            Ok(got) => Ok(self.shared.uncap(&key, got)),
            Err(e) if is_wrong_type(&e) => {
                self.shared.skip(&key, "not a string");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes an entry (its keys become misses) and tells the other replicas. Returns
    /// whether it was present. Applied after the writes queued before it.
    pub async fn delete(&self, id: EntryId) -> Result<bool, RedisError> {
        self.admin(|reply| Admin::Delete { id, reply }).await
    }

    /// Deletes every entry of a namespace and tells the other replicas; returns how many
    /// were present. Applied after the writes queued before it.
    pub async fn delete_namespace(&self, namespace: &str) -> Result<u64, RedisError> {
        let namespace = namespace.to_string();
        self.admin(|reply| Admin::DeleteNamespace { namespace, reply })
            .await
    }

    /// Deletes every entry stored with `tag` (see [`RedisTier::put_with_tags`]) and tells the
    /// other replicas, one delete event per entry; returns how many were present.
    pub async fn delete_tag(&self, tag: &str) -> Result<u64, RedisError> {
        let tag = tag.to_string();
        self.admin(|reply| Admin::DeleteTag { tag, reply }).await
    }

    /// Tells the other replicas that the entries with `tag` in the namespaces starting with
    /// `prefix` are being deleted (a tenant's tag delete, which deletes entry by entry): they
    /// fence the tag there and drop what they hold with it, answers whose puts never reached
    /// Redis included.
    ///
    /// Fences the tag within the prefix in Redis first, so a put already queued on another
    /// replica, or an answer generated across the delete, is refused there too.
    pub async fn announce_tag_within(&self, prefix: &str, tag: &str) -> Result<(), RedisError> {
        self.shared.fence_tag_within(prefix, tag).await?;
        let event = self
            .shared
            .event(events::OP_DEL_TAG_WITHIN, None, prefix)
            .arg("tag")
            .arg(tag)
            .clone();
        self.shared
            .run(Op::DeleteTag, |c| async move {
                c.query::<::redis::Value>(&event).await
            })
            .await
            .map(drop)
    }

    /// Tells the other replicas that the entries a filter selects are being deleted (an
    /// operator's filtered delete, which deletes entry by entry): they drop what they hold
    /// that it selects, answers whose puts never reached Redis included. See
    /// [`ReplicationEvent::DeleteWhere`]; a filter of no field is refused (`Config`).
    pub async fn announce_delete_where(
        &self,
        scope: Option<&str>,
        model: Option<&str>,
        created_until_ms: Option<u64>,
    ) -> Result<(), RedisError> {
        if scope.is_none() && model.is_none() && created_until_ms.is_none() {
            return Err(RedisError::Config(
                "a filtered delete needs a filter".into(),
            ));
        }
        let mut event = self.shared.event(events::OP_DEL_WHERE, None, "");
        if let Some(scope) = scope {
            event.arg("scope").arg(scope);
        }
        if let Some(model) = model {
            event.arg("model").arg(model);
        }
        if let Some(until) = created_until_ms {
            event.arg("until").arg(until);
        }
        self.shared
            .run(Op::Delete, |c| async move {
                c.query::<::redis::Value>(&event).await
            })
            .await
            .map(drop)
    }

    /// Sweeps every namespace and tag index set now: prunes the ids no longer kept and
    /// deletes the sets left empty (a background task does it every [`SWEEP_INTERVAL`], on
    /// one replica at a time).
    pub async fn sweep_indexes(&self) -> Result<Swept, RedisError> {
        self.shared.sweep_indexes().await
    }

    /// Waits until every write queued before this call has been applied (or dropped).
    pub async fn flush(&self) -> Result<(), RedisError> {
        self.admin(|reply| Admin::Flush { reply }).await
    }

    /// Every entry kept (on a cluster, from every master; expired ones within the retention
    /// included) in one `Vec`: for tests and small
    /// stores; a replica's rebuild streams them with [`RedisTier::scan_pages`].
    pub async fn scan_entries(&self, progress: impl Fn(usize)) -> Result<Vec<Entry>, RedisError> {
        let (tx, mut rx) = mpsc::channel::<Vec<Entry>>(4);
        let collect = async move {
            // A SCAN may return a key twice (while Redis rehashes).
            let mut out = Vec::new();
            let mut seen = HashSet::new();
            while let Some(page) = rx.recv().await {
                out.extend(page.into_iter().filter(|e: &Entry| seen.insert(e.id)));
            }
            out
        };
        let (scanned, out) = tokio::join!(self.scan_pages(tx, progress), collect);
        scanned.map(|_| out)
    }

    /// Every entry kept (on a cluster, from every master; expired ones within the retention
    /// included), to rebuild a replica's indexes,
    /// sent to `pages` one `SCAN` page at a time (so the keyspace is never held at once, not
    /// even its ids: an entry is sent twice in the rare case that `SCAN` returns its key
    /// twice, which a load or a delete takes as it took the first);
    /// the scan stops early, without error, when the receiver is dropped. Returns the count
    /// sent. `progress` is called with the running count after each page. Undecodable values
    /// are skipped. Each command is bounded by `timeout_ms`; the scan as a whole is not.
    pub async fn scan_pages(
        &self,
        pages: mpsc::Sender<Vec<Entry>>,
        progress: impl Fn(usize),
    ) -> Result<usize, RedisError> {
        let shared = &self.shared;
        let nodes = shared
            .run(Op::Scan, |c| async move { c.scan_nodes().await })
            .await?;
        let pattern = shared.keys.entry_pattern();
        let mut sent = 0usize;
        let mut next_log = SCAN_LOG_EVERY;
        for node in &nodes {
            let mut cursor: u64 = 0;
            loop {
                let (next, names) = shared
                    .scan_page(Op::Scan, node.as_ref(), &pattern, cursor)
                    .await?;
                let names: Vec<(String, EntryId)> = names
                    .into_iter()
                    .filter_map(|name| {
                        let id = shared.keys.id_of_entry_key(&name);
                        if id.is_none() {
                            shared.skip(&name, "not an entry key");
                        }
                        id.map(|id| (name, id))
                    })
                    .collect();
                // Read in parts of at most `SCAN_PAGE_BYTES` of values (by their lengths,
                // read first; one longer than the cap is skipped by the read itself).
                let lengths = shared.lengths(Op::Scan, &names).await?;
                let mut parts: Vec<std::ops::Range<usize>> = Vec::new();
                let (mut start, mut bytes) = (0, 0u64);
                for (i, n) in lengths.iter().enumerate() {
                    if i > start && bytes + n > SCAN_PAGE_BYTES {
                        parts.push(start..i);
                        (start, bytes) = (i, 0);
                    }
                    bytes += n;
                }
                parts.push(start..names.len());
                for part in parts {
                    let names = &names[part];
                    let values = shared.get_many(Op::Scan, names).await?;
                    let page: Vec<Entry> = names
                        .iter()
                        .zip(values)
                        .filter_map(|((name, id), raw)| shared.decode(name, *id, &raw?))
                        .collect();
                    sent += page.len();
                    if !page.is_empty() && pages.send(page).await.is_err() {
                        // The loader has what it can hold.
                        return Ok(sent);
                    }
                }
                progress(sent);
                if sent >= next_log {
                    tracing::info!(entries = sent, "redis: scanning entries");
                    next_log += SCAN_LOG_EVERY;
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(sent)
    }

    /// The events other replicas publish. `from_last`: only events after now; otherwise the
    /// whole retained stream first. A background task reads with `XREAD BLOCK`, reconnects
    /// with backoff and emits [`ReplicationEvent::Resync`] when events may have been lost.
    /// Dropping the stream stops the task.
    pub fn subscribe(&self, from_last: bool) -> ReplicationStream {
        self.subscriber(from_last).spawn()
    }

    /// [`RedisTier::subscribe`] from the newest event, resolved before it returns (within the
    /// command timeout): every event written after it returns is delivered, so a scan that
    /// starts after it misses nothing (a lazily resolved start could skip a delete written
    /// between the scan and the reader's first command). When Redis cannot be reached, the
    /// stream starts with [`ReplicationEvent::Resync`] once it can.
    pub async fn subscribe_from_now(&self) -> ReplicationStream {
        let mut subscriber = self.subscriber(true);
        subscriber.resolve_start().await;
        subscriber.spawn()
    }

    fn subscriber(&self, from_last: bool) -> events::Subscriber {
        events::Subscriber {
            connector: self.shared.connector.clone(),
            stream_key: self.shared.keys.events(),
            replica_id: self.shared.replica_id.clone(),
            connect_timeout: self.shared.connect_timeout,
            timeout: self.shared.timeout,
            from_last,
            errors: self.shared.metrics.errors(Op::Events).clone(),
            start: None,
            start_failed: false,
            conn: None,
        }
    }

    /// The tier's state now.
    pub fn health(&self) -> RedisHealth {
        let breaker_open = self.shared.breaker.is_open();
        RedisHealth {
            up: self.shared.up.load(Ordering::Relaxed) && !breaker_open,
            breaker_open,
            queued_writes: self.writes.max_capacity() - self.writes.capacity(),
            dropped_writes: self.shared.dropped.load(Ordering::Relaxed),
        }
    }

    /// This replica's id, as written in its events.
    pub fn replica_id(&self) -> &str {
        &self.shared.replica_id
    }

    /// The largest value read back (`RedisConfig::max_value_bytes`): a larger one written is
    /// skipped by every reader.
    pub fn max_value_bytes(&self) -> usize {
        self.shared.max_value_bytes
    }
}
