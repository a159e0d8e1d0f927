//! The write queue. Puts, aliases and blobs are queued and applied by one background task, a
//! batch at a time and concurrently; deletes and flushes go through the same queue, so they
//! apply after the writes queued before them, and their callers wait for the result.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ::redis::Value;
use futures::future::{join_all, try_join_all};
use tokio::sync::{mpsc, oneshot};

use super::conn::Conn;
use super::error::{is_wrong_type, RedisError};
use super::events;
use super::metrics::Op;
use super::shared::Capped;
use super::shared::Shared;
use super::{RedisTier, Updated};
use crate::entry::{now_ms, Digest, Entry, EntryId, Merged};

/// How long after an id is no longer kept (its score) it is pruned from an index set. Redis
/// expires the entry by its own clock, the pruning goes by this replica's: without a margin
/// a replica whose clock runs ahead would prune an id before its entry expires, and a
/// namespace or tag delete would then not find it.
pub(super) const INDEX_MARGIN_MS: u64 = 60_000;

/// The Lua function of the scripts that write index sets: whether the tag fences hash `key`
/// holds a fence within a prefix of namespace `ns` that ends after `bound` (the answer's
/// generation started before the fence).
macro_rules! tag_fenced {
    () => {
        "\
local function fenced_within(key, ns, bound)
  local fs = redis.call('HGETALL', key)
  for j = 1, #fs, 2 do
    if tonumber(fs[j + 1]) > bound and string.sub(ns, 1, #fs[j]) == fs[j] then return true end
  end
  return false
end
"
    };
}

/// Adds an id to an index sorted set (score = its expiry plus the retention of expired
/// entries: until when it is kept) and prunes ids no longer kept (`ARGV[3]`: now less
/// [`INDEX_MARGIN_MS`]). One script so the steps see one state; it touches a single key,
/// so it runs on a cluster too. Index sets never expire (`PERSIST`, for a set an older
/// version gave a TTL): under a `volatile-*` eviction policy Redis then never evicts one
/// before its entries (a delete would miss the entries only it listed); the ids pruned
/// here and by the sweep ([`super::sweep`]) bound them, and the sweep deletes the empty ones.
/// A set fenced by a delete after the answer's generation started (`ARGV[4]`: its start plus
/// [`FENCE_MS`]), or a tag set whose tag is fenced within a prefix of the entry's namespace
/// (`KEYS[2]`, the tag's fences, and `ARGV[5]`, the namespace; see [`tag_fenced`]), is left
/// alone and `0` returned: the entry must not be written.
const INDEX_SCRIPT: &str = concat!(
    tag_fenced!(),
    "\
local f = redis.call('ZSCORE', KEYS[1], 'fence')
if f and tonumber(f) > tonumber(ARGV[4]) then return 0 end
if #KEYS > 1 and fenced_within(KEYS[2], ARGV[5], tonumber(ARGV[4])) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
redis.call('PERSIST', KEYS[1])
return 1"
);

/// How long a namespace or tag delete fences, in Redis, the puts of answers whose generation
/// started before it: a put queued on another replica when the delete ran, or generated
/// across it, would otherwise bring the answer back for every replica. As long as a replica
/// fences them in memory ([`crate::store::FENCE_TTL`]).
const FENCE_MS: u64 = crate::store::FENCE_TTL.as_millis() as u64;
/// The member of an index set that is its fence, scored with when the fence ends (the
/// delete's time plus [`FENCE_MS`]): the sets' pruning of members no longer kept drops it
/// then. Never an entry id (those are 32 hex digits).
const FENCE_MEMBER: &str = "fence";

/// Fences an index set (see [`FENCE_MS`]): its fence ends at `ARGV[1]` at the earliest. The
/// set never expires (see [`INDEX_SCRIPT`]); the sweep prunes the fence once it has ended.
/// One key.
///
/// A tenant's tag delete fences the tag within the tenant's namespaces only: another
/// tenant's answers with the same tag are stored as ever. Its fence is a field of the tag's
/// fences hash ([`TAG_FENCE_SCRIPT`]): the namespace prefix, valued with when the fence ends;
/// a put checks the hash of each of its tags ([`tag_fenced`]).
const FENCE_SCRIPT: &str = "\
local f = redis.call('ZSCORE', KEYS[1], 'fence')
if not f or tonumber(f) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], ARGV[1], 'fence')
end
redis.call('PERSIST', KEYS[1])
return 1";

/// Fences a tag within a namespace prefix (`KEYS[1]`: the tag's fences; `ARGV`: the prefix,
/// when the fence ends, how long the hash lasts at least, now). The hash expires once its
/// last fence has ended, and each fence placed drops the ended ones: it holds one field per
/// prefix fenced within the last [`FENCE_MS`].
const TAG_FENCE_SCRIPT: &str = "\
local fs = redis.call('HGETALL', KEYS[1])
for j = 1, #fs, 2 do
  if tonumber(fs[j + 1]) < tonumber(ARGV[4]) then redis.call('HDEL', KEYS[1], fs[j]) end
end
local f = redis.call('HGET', KEYS[1], ARGV[1])
if not f or tonumber(f) < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1";

/// A whole put on a single server, in one step: index sets first (as [`INDEX_SCRIPT`]), then
/// the entry, its exact keys and the event. Nothing is written, and `0` returned, when the
/// entry was deleted (`KEYS[3]`, its mark) or a set is fenced by a delete after the answer's
/// generation started (`ARGV[10]`: its start plus [`FENCE_MS`]); then a delete event of no
/// replica's tells every replica, the writer too, to drop it (see [`Shared::refused`]). A
/// failing index (say, a foreign value under an
/// index key) aborts the script before the entry is written, so no entry is ever stored
/// without its index entries, where a namespace or tag delete could not find it; and nothing
/// else runs between the steps. `KEYS`: entry, events, the entry's deleted mark, `ARGV[6]`
/// index sets, exact keys, then the fences hashes of its `ARGV[11]` tags.
/// `ARGV`: value, ttl, expiry, id, the pruning bound (now less [`INDEX_MARGIN_MS`]), index
/// count, events maxlen, namespace, origin, the fence bound, tag count.
const PUT_SCRIPT: &str = concat!(
    tag_fenced!(),
    "\
local ttl = tonumber(ARGV[2])
local nidx = tonumber(ARGV[6])
local started = tonumber(ARGV[10])
local ntags = tonumber(ARGV[11])
local function refuse()
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'op', 'del', 'id', ARGV[4], 'ns', '', 'origin', '')
  return 0
end
if redis.call('EXISTS', KEYS[3]) == 1 then return refuse() end
for i = 4, 3 + nidx do
  local f = redis.call('ZSCORE', KEYS[i], 'fence')
  if f and tonumber(f) > started then return refuse() end
end
for i = #KEYS - ntags + 1, #KEYS do
  if fenced_within(KEYS[i], ARGV[8], started) then return refuse() end
end
for i = 4, 3 + nidx do
  redis.call('ZADD', KEYS[i], ARGV[3], ARGV[4])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[5])
  redis.call('PERSIST', KEYS[i])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
for i = 4 + nidx, #KEYS - ntags do
  redis.call('SET', KEYS[i], ARGV[4], 'PX', ttl)
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'op', 'put', 'id', ARGV[4], 'ns', ARGV[8], 'origin', ARGV[9])
return 1"
);

/// Whether a tag is fenced within a prefix of the put's namespace (`KEYS[1]`: the tag's
/// fences; `ARGV`: the namespace, the fence bound): `1` when it is. On a cluster, for a tag
/// whose set key hashes whole (an empty hash tag: the tag starts with `}`), so that its
/// fences cannot share the set's slot and [`INDEX_SCRIPT`] cannot read them.
const FENCED_APART: &str = concat!(
    tag_fenced!(),
    "\
if fenced_within(KEYS[1], ARGV[1], tonumber(ARGV[2])) then return 1 end
return 0"
);

/// Stores an entry (`KEYS[1]`, `ARGV`: value, ttl) unless its deleted mark (`KEYS[2]`, the
/// same slot) is there: `1` when written, `0` when not.
const STORE_UNLESS_DELETED: &str = "\
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1";

/// Writes taken from the queue at once; puts and aliases of one batch run concurrently.
const WRITE_BATCH: usize = 64;
/// Ids deleted per round of a namespace or tag delete.
const DELETE_BATCH: usize = 500;
/// Deletes wait behind the writes queued before them (so an older pending put cannot bring
/// back what was just deleted); this many command timeouts bound the caller's wait.
const ADMIN_WAIT_FACTOR: u32 = 50;

/// One put's place and lifetime (see [`Shared::put`]).
struct Put<'a> {
    id: EntryId,
    namespace: &'a str,
    /// Until when Redis keeps it (expiry plus the stale windows), in ms since the epoch.
    kept_until: u64,
    now: u64,
    /// Milliseconds from `now` to `kept_until`.
    ttl: u64,
    /// When the answer's generation started (ms since the epoch): a namespace or tag
    /// delete after it fences the put out.
    started: u64,
    keys: &'a [Digest],
    tags: &'a [String],
}

/// What the write queue carries.
pub(super) enum Queued {
    /// A put or alias; consecutive ones are applied concurrently.
    Write(Write),
    /// A delete or flush; applied alone, after everything queued before it.
    Admin(Admin),
}

/// A queued put or alias.
pub(super) enum Write {
    Put {
        id: EntryId,
        namespace: String,
        expires_ms: u64,
        /// When the answer's generation started (its creation less its generation time).
        started_ms: u64,
        bytes: Vec<u8>,
        keys: Vec<Digest>,
        tags: Vec<String>,
    },
    Alias {
        key: Digest,
        id: EntryId,
        expires_ms: u64,
        /// Only where the key leads nowhere yet (`SET NX`): another replica's answer for it
        /// stays.
        unclaimed: bool,
    },
    /// A named value, without expiry or for `ttl_ms` (see [`RedisTier::put_blob`]).
    Blob {
        name: String,
        bytes: Vec<u8>,
        ttl_ms: Option<u64>,
    },
    /// One field of a named hash, the hash kept for `ttl_ms` (see [`RedisTier::put_field`]).
    Field {
        name: String,
        field: String,
        bytes: Vec<u8>,
        ttl_ms: u64,
    },
}

/// Sets one field of a hash and the hash's lifetime: `ARGV` = field, value, milliseconds.
/// One key, so it runs on a cluster too.
const PUT_FIELD: &str = "\
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1";

/// A queued operation whose caller waits for the result.
pub(super) enum Admin {
    Delete {
        id: EntryId,
        reply: oneshot::Sender<Result<bool, RedisError>>,
    },
    DeleteNamespace {
        namespace: String,
        reply: oneshot::Sender<Result<u64, RedisError>>,
    },
    DeleteTag {
        tag: String,
        reply: oneshot::Sender<Result<u64, RedisError>>,
    },
    Flush {
        reply: oneshot::Sender<Result<(), RedisError>>,
    },
    /// A changed copy of an entry (see [`RedisTier::update`]).
    Update {
        entry: Box<Entry>,
        reply: oneshot::Sender<Result<Updated, RedisError>>,
    },
    /// A named value taken (see [`RedisTier::take_blob`]).
    TakeBlob {
        name: String,
        replacement: Vec<u8>,
        reply: oneshot::Sender<Result<Option<Vec<u8>>, RedisError>>,
    },
    /// A named value marked unless spent (see [`RedisTier::mark_blob`]).
    MarkBlob {
        name: String,
        spent: Vec<u8>,
        marked: Vec<u8>,
        reply: oneshot::Sender<Result<Option<bool>, RedisError>>,
    },
}

/// Replaces a value with `ARGV[2]`, keeping its lifetime, unless it is `ARGV[1]`: `1` when
/// replaced, `-1` when it was `ARGV[1]`, `0` when there is none. One key.
const MARK_SCRIPT: &str = "\
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if held == ARGV[1] then return -1 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1";

/// Replaces a value that is there with `ARGV[1]`, keeping its lifetime, and returns what it
/// was (`false`: nothing there, nothing written; its length when over `ARGV[2]` bytes: taken,
/// never sent). One key.
const TAKE_SCRIPT: &str = "\
local n = redis.call('STRLEN', KEYS[1])
if n == 0 then return false end
local held = false
if n <= tonumber(ARGV[2]) then held = redis.call('GET', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
if held then return held end
return n";

/// Replaces an entry's value only if it is still the one read (`ARGV[1]`), keeping its
/// lifetime: `1` when written, `0` when it changed meanwhile or is gone. One key.
const SWAP_SCRIPT: &str = "\
local held = redis.call('GET', KEYS[1])
if not held or held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1";
/// Points a key at `ARGV[2]` for `ARGV[3]` milliseconds only if it still holds `ARGV[1]`:
/// `1` when written, `0` when it changed meanwhile or is gone. One key.
const SWAP_KEY_SCRIPT: &str = "\
local held = redis.call('GET', KEYS[1])
if not held or held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1";

/// Rounds of read, merge and swap an update tries before giving up.
const UPDATE_ROUNDS: usize = 8;

impl RedisTier {
    /// Puts a write on the queue, or drops it.
    pub(super) fn enqueue(&self, write: Write) -> bool {
        // While the breaker fails fast, queueing would only delay the drop.
        if self.shared.breaker.fails_fast() {
            self.shared.drop_write();
            return false;
        }
        // Bounded by bytes as well as by count: one write may be megabytes.
        let bytes = write.bytes();
        let queued = self.shared.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
        if queued + bytes > self.shared.queue_bytes {
            self.shared.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            self.shared.drop_write();
            return false;
        }
        match self.writes.try_send(Queued::Write(write)) {
            Ok(()) => true,
            Err(_) => {
                self.shared.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
                self.shared.drop_write();
                false
            }
        }
    }

    /// Sends an operation through the write queue and waits for its result.
    pub(super) async fn admin<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, RedisError>>) -> Admin,
    ) -> Result<T, RedisError> {
        if self.shared.breaker.fails_fast() {
            return Err(RedisError::Unavailable);
        }
        let (tx, rx) = oneshot::channel();
        let wait = self.shared.timeout * ADMIN_WAIT_FACTOR;
        let done = async {
            self.writes
                .send(Queued::Admin(make(tx)))
                .await
                .map_err(|_| RedisError::Unavailable)?;
            rx.await.map_err(|_| RedisError::Unavailable)?
        };
        tokio::time::timeout(wait, done)
            .await
            .unwrap_or(Err(RedisError::Timeout))
    }
}

impl Shared {
    /// An `XADD` of an event, its fields (`op` first) to follow, trimmed approximately (`~`
    /// lets Redis trim whole nodes, which is much cheaper than an exact length).
    pub(super) fn xadd(&self, op: &str) -> ::redis::Cmd {
        ::redis::cmd("XADD")
            .arg(self.keys.events())
            .arg("MAXLEN")
            .arg("~")
            .arg(self.events_maxlen)
            .arg("*")
            .arg("op")
            .arg(op)
            .clone()
    }

    /// An `XADD` of one event of this replica's.
    pub(super) fn event(&self, op: &str, id: Option<EntryId>, namespace: &str) -> ::redis::Cmd {
        self.xadd(op)
            .arg("id")
            .arg(id.map(|id| id.to_string()).unwrap_or_default())
            .arg("ns")
            .arg(namespace)
            .arg("origin")
            .arg(&self.replica_id)
            .clone()
    }

    /// The event of a put refused by a delete's fence or mark: a delete of no replica's
    /// (`origin` empty), so every replica drops the entry, the one that generated it too
    /// (it kept it in memory; its delete event may never reach it, past a trimmed stream).
    fn refused(&self, id: EntryId) -> ::redis::Cmd {
        self.xadd(events::OP_DEL)
            .arg("id")
            .arg(id.to_string())
            .arg("ns")
            .arg("")
            .arg("origin")
            .arg("")
            .clone()
    }

    /// Applies a batch of puts and aliases concurrently; failures are counted as dropped.
    async fn apply_writes(&self, writes: Vec<Write>) {
        if writes.is_empty() {
            return;
        }
        let results = join_all(writes.into_iter().map(|w| self.apply_write(w))).await;
        for r in results {
            if r.is_err() {
                self.drop_write();
            }
        }
    }

    /// Points the key `name`, which held something when an unclaimed alias to `id` was
    /// tried, at `id` after all when what it holds leads nowhere: an entry deleted, expired
    /// or refused everywhere leaves keys behind, and they must not keep the question from
    /// being linked again. Each step touches one key (the key, then the entry it names), so
    /// it runs on a cluster too; the swap only happens if the key still holds what was read.
    async fn claim_stale(&self, name: String, id: EntryId, ttl: u64) -> Result<(), RedisError> {
        let get = ::redis::cmd("GETRANGE").arg(&name).arg(0).arg(63).clone();
        let held: Option<Vec<u8>> = self
            .run(Op::Alias, |c| async move { c.query(&get).await })
            .await?;
        let Some(held) = held.filter(|h| !h.is_empty()) else {
            // Gone meanwhile: whoever writes next takes it.
            return Ok(());
        };
        let held_id = std::str::from_utf8(&held)
            .ok()
            .and_then(|s| s.parse::<EntryId>().ok());
        match held_id {
            Some(h) if h == id => return Ok(()),
            Some(h) => {
                let exists = ::redis::cmd("EXISTS").arg(self.keys.entry(h)).clone();
                let live: i64 = self
                    .run(Op::Alias, |c| async move { c.query(&exists).await })
                    .await?;
                if live > 0 {
                    // Another answer for the question stays.
                    return Ok(());
                }
            }
            // Not an entry id: nothing a reader can follow.
            None => {}
        }
        let swap = ::redis::cmd("EVAL")
            .arg(SWAP_KEY_SCRIPT)
            .arg(1)
            .arg(&name)
            .arg(held)
            .arg(id.to_string())
            .arg(ttl)
            .clone();
        self.run(Op::Alias, |c| async move { c.query::<Value>(&swap).await })
            .await
            .map(drop)
    }

    async fn apply_write(&self, write: Write) -> Result<(), RedisError> {
        match write {
            Write::Put {
                id,
                namespace,
                expires_ms,
                started_ms,
                bytes,
                keys,
                tags,
            } => {
                // Kept past its expiry for the stale windows: the entry, its keys and its
                // index entries alike (a namespace or tag delete must reach a kept entry).
                let now = now_ms();
                let until = self.kept_until(expires_ms);
                let ttl = until.saturating_sub(now);
                if ttl == 0 {
                    return Ok(());
                }
                let put = Put {
                    id,
                    namespace: &namespace,
                    kept_until: until,
                    now,
                    ttl,
                    started: started_ms,
                    keys: &keys,
                    tags: &tags,
                };
                self.put(put, bytes).await
            }
            Write::Alias {
                key,
                id,
                expires_ms,
                unclaimed,
            } => {
                let ttl = self.kept_until(expires_ms).saturating_sub(now_ms());
                if ttl == 0 {
                    return Ok(());
                }
                let name = self.keys.key(&key);
                let mut cmd = ::redis::cmd("SET");
                cmd.arg(&name).arg(id.to_string()).arg("PX").arg(ttl);
                if !unclaimed {
                    return self
                        .run(Op::Alias, |c| async move { c.query::<Value>(&cmd).await })
                        .await
                        .map(drop);
                }
                cmd.arg("NX");
                let set: Value = self
                    .run(Op::Alias, |c| async move { c.query(&cmd).await })
                    .await?;
                if matches!(set, Value::Okay) {
                    return Ok(());
                }
                self.claim_stale(name, id, ttl).await
            }
            Write::Blob {
                name,
                bytes,
                ttl_ms,
            } => {
                let mut cmd = ::redis::cmd("SET");
                cmd.arg(self.keys.blob(&name)).arg(bytes);
                if let Some(ttl) = ttl_ms {
                    cmd.arg("PX").arg(ttl.max(1));
                }
                self.run(Op::Put, |c| async move { c.query::<Value>(&cmd).await })
                    .await
                    .map(drop)
            }
            Write::Field {
                name,
                field,
                bytes,
                ttl_ms,
            } => {
                let cmd = ::redis::cmd("EVAL")
                    .arg(PUT_FIELD)
                    .arg(1)
                    .arg(self.keys.hash(&name))
                    .arg(field)
                    .arg(bytes)
                    .arg(ttl_ms.max(1))
                    .clone();
                self.run(Op::Put, |c| async move { c.query::<Value>(&cmd).await })
                    .await
                    .map(drop)
            }
        }
    }

    /// Stores an entry with its keys and index entries, never the entry without its index
    /// entries: on a single server in one script ([`PUT_SCRIPT`]); on a cluster, where they
    /// live in different slots, index sets first, then (only when they were written) the
    /// entry and its keys, then the event.
    async fn put(&self, put: Put<'_>, bytes: Vec<u8>) -> Result<(), RedisError> {
        let Put {
            id,
            namespace,
            kept_until,
            now,
            ttl,
            started,
            keys,
            tags,
        } = put;
        let fence_bound = started.saturating_add(FENCE_MS);
        let prune_below = now.saturating_sub(INDEX_MARGIN_MS);
        let id_str = id.to_string();
        let indexes: Vec<String> = std::iter::once(self.keys.namespace(namespace))
            .chain(tags.iter().map(|t| self.keys.tag(t)))
            .collect();
        let cluster = self.conn.read().is_cluster();
        if !cluster {
            let mut cmd = ::redis::cmd("EVAL");
            cmd.arg(PUT_SCRIPT)
                .arg(3 + indexes.len() + keys.len() + tags.len())
                .arg(self.keys.entry(id))
                .arg(self.keys.events())
                .arg(self.keys.deleted(id))
                .arg(&indexes);
            for key in keys {
                cmd.arg(self.keys.key(key));
            }
            for tag in tags {
                cmd.arg(self.keys.tag_fences(tag));
            }
            cmd.arg(bytes)
                .arg(ttl)
                .arg(kept_until)
                .arg(&id_str)
                .arg(prune_below)
                .arg(indexes.len())
                .arg(self.events_maxlen)
                .arg(namespace)
                .arg(&self.replica_id)
                .arg(fence_bound)
                .arg(tags.len());
            let written = self
                .run(Op::Put, |c| async move { c.query::<i64>(&cmd).await })
                .await?;
            if written == 0 {
                tracing::debug!(%id, "redis: put fenced by a delete after its generation began");
            }
            return Ok(());
        }
        // After the entry is written, each index set must still hold it: a namespace or tag
        // delete that ran between the two (it read the set, deleted an entry not yet there,
        // took the id out of the set) would otherwise leave it stored outside its index.
        let still_indexed: Vec<::redis::Cmd> = indexes
            .iter()
            .map(|name| ::redis::cmd("ZSCORE").arg(name).arg(&id_str).clone())
            .collect();
        let unstore = ::redis::cmd("DEL").arg(self.keys.entry(id)).clone();
        // The namespace set first, then each tag's set with the tag's fences (one slot),
        // but for a tag whose set hashes whole (it starts with `}`): its fences are read
        // apart, just before.
        let apart_slot = |t: &String| t.starts_with('}');
        let fences = std::iter::once(None).chain(
            tags.iter()
                .map(|t| (!apart_slot(t)).then(|| self.keys.tag_fences(t))),
        );
        let apart: Vec<::redis::Cmd> = tags
            .iter()
            .filter(|t| apart_slot(t))
            .map(|t| {
                ::redis::cmd("EVAL")
                    .arg(FENCED_APART)
                    .arg(1)
                    .arg(self.keys.tag_fences(t))
                    .arg(namespace)
                    .arg(fence_bound)
                    .clone()
            })
            .collect();
        let index: Vec<::redis::Cmd> = indexes
            .into_iter()
            .zip(fences)
            .map(|(name, fences)| {
                let mut cmd = ::redis::cmd("EVAL");
                cmd.arg(INDEX_SCRIPT)
                    .arg(1 + usize::from(fences.is_some()))
                    .arg(name);
                if let Some(fences) = fences {
                    cmd.arg(fences);
                }
                cmd.arg(kept_until)
                    .arg(&id_str)
                    .arg(prune_below)
                    .arg(fence_bound)
                    .arg(namespace);
                cmd
            })
            .collect();
        // The entry, unless it was deleted (its mark shares its slot), then its keys.
        let store = ::redis::cmd("EVAL")
            .arg(STORE_UNLESS_DELETED)
            .arg(2)
            .arg(self.keys.entry(id))
            .arg(self.keys.deleted(id))
            .arg(bytes)
            .arg(ttl)
            .clone();
        let mut sets = Vec::with_capacity(keys.len());
        for key in keys {
            sets.push(
                ::redis::cmd("SET")
                    .arg(self.keys.key(key))
                    .arg(&id_str)
                    .arg("PX")
                    .arg(ttl)
                    .clone(),
            );
        }
        let event = self.event(events::OP_PUT, Some(id), namespace);
        let refused = self.refused(id);
        self.run(Op::Put, |c| async move {
            if run_all(c.clone(), apart)
                .await?
                .iter()
                .any(|v| matches!(v, Value::Int(1)))
            {
                return c.query::<Value>(&refused).await;
            }
            let indexed = run_all(c.clone(), index).await?;
            // Fenced or deleted: the entry is not written (an id left in another set leads
            // nowhere), and the replicas are told to drop it.
            if indexed.iter().any(|v| matches!(v, Value::Int(0)))
                || c.query::<i64>(&store).await? == 0
            {
                return c.query::<Value>(&refused).await;
            }
            run_all(c.clone(), sets).await?;
            for check in &still_indexed {
                if c.query::<Option<f64>>(check).await?.is_none() {
                    // Deleted meanwhile: the delete wins (its keys lead nowhere now).
                    return c.query::<Value>(&unstore).await;
                }
            }
            c.query::<Value>(&event).await
        })
        .await
        .map(drop)
    }

    /// Writes a changed copy of an entry over the one Redis holds, with the refusals the
    /// held one has and this copy lacks (another replica's, written meanwhile): read, merge,
    /// then swap only if the value is still the one read, again on a change. `false` when
    /// Redis does not hold the entry (deleted: it stays so) or kept changing.
    async fn update(&self, mut entry: Entry) -> Result<Updated, RedisError> {
        let name = self.keys.entry(entry.id);
        for _ in 0..UPDATE_ROUNDS {
            let read = self.capped_get(&name);
            let got = self
                .run(Op::Put, |c| async move { c.query::<Capped>(&read).await })
                .await?;
            if matches!(got, Capped::Absent) {
                return Ok(Updated::Gone);
            }
            let Some(raw) = self.uncap(&name, got) else {
                return Ok(Updated::NotWritten);
            };
            if let Some(held) = self.decode(&name, entry.id, &raw) {
                if entry.merge_refusals(&held) == Merged::Full {
                    return Ok(Updated::Full);
                }
            }
            let bytes = super::stored_value(&entry).ok();
            let Some(bytes) = bytes else {
                tracing::warn!(id = %entry.id, "redis: entry not serialisable; not updated");
                return Ok(Updated::NotWritten);
            };
            let swap = ::redis::cmd("EVAL")
                .arg(SWAP_SCRIPT)
                .arg(1)
                .arg(&name)
                .arg(raw)
                .arg(bytes)
                .clone();
            let swapped = self
                .run(Op::Put, |c| async move { c.query::<i64>(&swap).await })
                .await?;
            if swapped == 1 {
                let event = self.event(events::OP_PUT, Some(entry.id), &entry.namespace);
                self.run(Op::Put, |c| async move { c.query::<Value>(&event).await })
                    .await?;
                return Ok(Updated::Written);
            }
        }
        Ok(Updated::NotWritten)
    }

    /// Applies a delete or flush and answers its caller.
    async fn apply_admin(&self, op: Admin) {
        match op {
            Admin::Delete { id, reply } => {
                // Marked first: a put of it from another replica, queued or generated when
                // the delete ran, is refused.
                let mark = ::redis::cmd("SET")
                    .arg(self.keys.deleted(id))
                    .arg(1)
                    .arg("PX")
                    .arg(FENCE_MS)
                    .clone();
                let del = ::redis::cmd("DEL").arg(self.keys.entry(id)).clone();
                let event = self.event(events::OP_DEL, Some(id), "");
                let result = self
                    .run(Op::Delete, |c| async move {
                        c.query::<Value>(&mark).await?;
                        let (n, _): (u64, Value) =
                            futures::try_join!(c.query(&del), c.query(&event))?;
                        Ok(n > 0)
                    })
                    .await;
                let _ = reply.send(result);
            }
            Admin::DeleteNamespace { namespace, reply } => {
                let index = self.keys.namespace(&namespace);
                let event = self.event(events::OP_DEL_NS, None, &namespace);
                let result = self
                    .delete_indexed(Op::DeleteNamespace, &index, event, false)
                    .await;
                let _ = reply.send(result);
            }
            Admin::DeleteTag { tag, reply } => {
                let index = self.keys.tag(&tag);
                // Besides each entry's delete: replicas fence the tag against answers being
                // generated when it was deleted, and drop what they hold with it.
                let event = self
                    .event(events::OP_DEL_TAG, None, "")
                    .arg("tag")
                    .arg(&tag)
                    .clone();
                let result = self
                    .delete_indexed(Op::DeleteTag, &index, event, true)
                    .await;
                let _ = reply.send(result);
            }
            Admin::Flush { reply } => {
                let _ = reply.send(Ok(()));
            }
            Admin::Update { entry, reply } => {
                let _ = reply.send(self.update(*entry).await);
            }
            Admin::TakeBlob {
                name,
                replacement,
                reply,
            } => {
                let key = self.keys.blob(&name);
                let cmd = ::redis::cmd("EVAL")
                    .arg(TAKE_SCRIPT)
                    .arg(1)
                    .arg(&key)
                    .arg(replacement)
                    .arg(self.max_value_bytes)
                    .clone();
                let result = match self
                    .run(Op::Put, |c| async move { c.query::<Capped>(&cmd).await })
                    .await
                {
                    Ok(got) => Ok(self.uncap(&key, got)),
                    Err(e) if is_wrong_type(&e) => {
                        self.skip(&key, "not a string");
                        Ok(None)
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(result);
            }
            Admin::MarkBlob {
                name,
                spent,
                marked,
                reply,
            } => {
                let key = self.keys.blob(&name);
                let cmd = ::redis::cmd("EVAL")
                    .arg(MARK_SCRIPT)
                    .arg(1)
                    .arg(&key)
                    .arg(spent)
                    .arg(marked)
                    .clone();
                let result = match self
                    .run(Op::Put, |c| async move { c.query::<i64>(&cmd).await })
                    .await
                {
                    Ok(1) => Ok(Some(true)),
                    Ok(-1) => Ok(Some(false)),
                    Ok(_) => Ok(None),
                    Err(e) if is_wrong_type(&e) => {
                        self.skip(&key, "not a string");
                        Ok(None)
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(result);
            }
        }
    }

    /// Fences `tag` within the namespaces starting with `prefix` ([`TAG_FENCE_SCRIPT`]): a put
    /// of an answer with the tag in such a namespace, generated before now, is refused.
    pub(super) async fn fence_tag_within(&self, prefix: &str, tag: &str) -> Result<(), RedisError> {
        let fence = ::redis::cmd("EVAL")
            .arg(TAG_FENCE_SCRIPT)
            .arg(1)
            .arg(self.keys.tag_fences(tag))
            .arg(prefix)
            .arg(now_ms().saturating_add(FENCE_MS))
            .arg(FENCE_MS.saturating_add(INDEX_MARGIN_MS))
            .arg(now_ms())
            .clone();
        self.run(
            Op::DeleteTag,
            |c| async move { c.query::<Value>(&fence).await },
        )
        .await
        .map(drop)
    }

    /// Deletes the entries listed in an index sorted set, a batch at a time, removing them
    /// from the index as it goes (ids added meanwhile by concurrent puts stay). Returns how
    /// many entries were present. `per_entry_events`: publish a delete event per entry.
    /// First the set is fenced ([`FENCE_MS`]), so a put of an answer generated before the
    /// delete, arriving from another replica during it or after, is not written; then
    /// `event` tells the replicas (before the rounds: a delete that fails midway has already
    /// emptied part of the set, and the replicas must drop and fence it all the same).
    async fn delete_indexed(
        &self,
        op: Op,
        index: &str,
        event: ::redis::Cmd,
        per_entry_events: bool,
    ) -> Result<u64, RedisError> {
        let fence = ::redis::cmd("EVAL")
            .arg(FENCE_SCRIPT)
            .arg(1)
            .arg(index)
            .arg(now_ms().saturating_add(FENCE_MS))
            .clone();
        self.run(op, |c| async move { c.query::<Value>(&fence).await })
            .await?;
        self.run(op, |c| async move { c.query::<Value>(&event).await })
            .await?;
        let mut deleted = 0;
        loop {
            let range = ::redis::cmd("ZRANGE")
                .arg(index)
                .arg(0)
                .arg(DELETE_BATCH - 1)
                .arg("WITHSCORES")
                .clone();
            let scored: Vec<(String, f64)> = self
                .run(op, |c| async move { c.query(&range).await })
                .await?;
            // The set's fence (placed before this delete began) stays.
            let scored: Vec<(String, f64)> = scored
                .into_iter()
                .filter(|(m, _)| m != FENCE_MEMBER)
                .collect();
            if scored.is_empty() {
                return Ok(deleted);
            }
            let members: Vec<&String> = scored.iter().map(|(m, _)| m).collect();
            let ids: Vec<EntryId> = members.iter().filter_map(|m| m.parse().ok()).collect();
            let mut cmds: Vec<::redis::Cmd> = ids
                .iter()
                .map(|id| ::redis::cmd("DEL").arg(self.keys.entry(*id)).clone())
                .collect();
            let dels = cmds.len();
            if per_entry_events {
                cmds.extend(
                    ids.iter()
                        .map(|id| self.event(events::OP_DEL, Some(*id), "")),
                );
            }
            // Out of the set first, then deleted: a cluster put that wrote its entry after the
            // round read the set finds its id gone (and unstores itself), or its entry is
            // deleted after it was written. Concurrently, the set's server could take the
            // id out after the put checked it, and the entry outlive its delete.
            let zrem = ::redis::cmd("ZREM").arg(index).arg(&members).clone();
            self.run(op, |c| async move { c.query::<Value>(&zrem).await })
                .await?;
            let replies = match self.run(op, |c| run_all(c, cmds)).await {
                Ok(replies) => replies,
                Err(e) => {
                    // Back into the set (best effort), so the delete asked again finds them.
                    let mut zadd = ::redis::cmd("ZADD");
                    zadd.arg(index);
                    for (m, score) in &scored {
                        zadd.arg(*score).arg(m);
                    }
                    let restored = self
                        .run(op, |c| async move { c.query::<Value>(&zadd).await })
                        .await;
                    if let Err(r) = restored {
                        tracing::warn!(error = %r, index, "redis: ids of a failed delete not put back");
                    }
                    return Err(e);
                }
            };
            deleted += replies[..dels]
                .iter()
                .map(|v| match v {
                    Value::Int(n) => *n as u64,
                    _ => 0,
                })
                .sum::<u64>();
        }
    }
}

/// Runs independent commands concurrently on one handle (pipelined on the wire by the
/// multiplexed connection; routed per key on a cluster).
pub(super) async fn run_all(c: Conn, cmds: Vec<::redis::Cmd>) -> ::redis::RedisResult<Vec<Value>> {
    try_join_all(cmds.iter().map(|cmd| c.query::<Value>(cmd))).await
}

/// Applies queued writes until every [`RedisTier`] clone is dropped. Puts and aliases taken
/// together run concurrently; a delete or flush waits for the writes before it.
pub(super) async fn write_loop(shared: Arc<Shared>, mut rx: mpsc::Receiver<Queued>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    let mut writes = Vec::new();
    while rx.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        for queued in batch.drain(..) {
            match queued {
                Queued::Write(write) => writes.push(write),
                Queued::Admin(admin) => {
                    shared.apply_queued(std::mem::take(&mut writes)).await;
                    shared.apply_admin(admin).await;
                }
            }
        }
        shared.apply_queued(std::mem::take(&mut writes)).await;
    }
}

impl Write {
    /// Bytes the write holds while queued (what the queue's byte budget counts).
    pub(super) fn bytes(&self) -> u64 {
        let n = match self {
            Write::Put {
                namespace,
                bytes,
                keys,
                tags,
                ..
            } => {
                namespace.len()
                    + bytes.len()
                    + keys.len() * 32
                    + tags.iter().map(|t| t.len() + 24).sum::<usize>()
            }
            Write::Alias { .. } => 64,
            Write::Blob { name, bytes, .. } => name.len() + bytes.len(),
            Write::Field {
                name, field, bytes, ..
            } => name.len() + field.len() + bytes.len(),
        };
        (n + 64) as u64
    }
}

impl Shared {
    /// Applies writes taken from the queue, then frees their bytes in the queue's budget.
    async fn apply_queued(&self, writes: Vec<Write>) {
        let bytes: u64 = writes.iter().map(Write::bytes).sum();
        self.apply_writes(writes).await;
        self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
}
