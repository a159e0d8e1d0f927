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
use super::put::{Put, FENCE_MS};
use super::shared::Capped;
use super::shared::Shared;
use super::{RedisTier, Updated};
use crate::entry::{now_ms, Digest, Entry, EntryId, Merged};

/// Writes taken from the queue at once; puts and aliases of one batch run concurrently.
const WRITE_BATCH: usize = 64;
/// Deletes wait behind the writes queued before them (so an older pending put cannot bring
/// back what was just deleted); this many command timeouts bound the caller's wait.
const ADMIN_WAIT_FACTOR: u32 = 50;

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
    pub(super) fn refused(&self, id: EntryId) -> ::redis::Cmd {
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
