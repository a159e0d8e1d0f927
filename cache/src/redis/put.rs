//! Puts into Redis and the fences of deletes: the scripts that write an entry with its
//! index entries (never the entry without them), refuse an answer a delete fenced out, and
//! delete what an index set lists.

use ::redis::Value;

use super::error::RedisError;
use super::events;
use super::metrics::Op;
use super::shared::Shared;
use super::writer::run_all;
use crate::entry::{now_ms, Digest, EntryId};

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
pub(super) const FENCE_MS: u64 = crate::store::FENCE_TTL.as_millis() as u64;
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

/// Ids deleted per round of a namespace or tag delete.
const DELETE_BATCH: usize = 500;

/// One put's place and lifetime (see [`Shared::put`]).
pub(super) struct Put<'a> {
    pub(super) id: EntryId,
    pub(super) namespace: &'a str,
    /// Until when Redis keeps it (expiry plus the stale windows), in ms since the epoch.
    pub(super) kept_until: u64,
    pub(super) now: u64,
    /// Milliseconds from `now` to `kept_until`.
    pub(super) ttl: u64,
    /// When the answer's generation started (ms since the epoch): a namespace or tag
    /// delete after it fences the put out.
    pub(super) started: u64,
    pub(super) keys: &'a [Digest],
    pub(super) tags: &'a [String],
}

impl Shared {
    /// Stores an entry with its keys and index entries, never the entry without its index
    /// entries: on a single server in one script ([`PUT_SCRIPT`]); on a cluster, where they
    /// live in different slots, index sets first, then (only when they were written) the
    /// entry and its keys, then the event.
    pub(super) async fn put(&self, put: Put<'_>, bytes: Vec<u8>) -> Result<(), RedisError> {
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
    pub(super) async fn delete_indexed(
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
