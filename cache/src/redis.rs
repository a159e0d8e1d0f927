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
//! | `{prefix}:e:{<id>}`        | `{"v":1,"entry":{...}}` (JSON envelope) | entry's own     |
//! | `{prefix}:k:<hex digest>`  | entry id (32 hex chars)                 | entry's / alias |
//! | `{prefix}:ns:{<ns>}`       | sorted set of ids, score = expiry ms    | longest member  |
//! | `{prefix}:tag:{<tag>}`     | sorted set of ids, score = expiry ms    | longest member  |
//! | `{prefix}:events`          | stream of `op`, `id`, `ns`, `origin`    | `MAXLEN ~`      |
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
//!
//! A value that does not decode (corrupt, written by something else under the prefix, or a
//! future envelope version) is skipped: the read is a miss, `reprise_redis_skipped_total`
//! counts it.

mod breaker;
mod conn;
mod events;

use std::collections::HashSet;
use std::fmt::{self, Write as _};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::redis::Value;
use futures::future::{join_all, try_join_all};
use metrics::{describe_counter, describe_gauge, describe_histogram, Counter, Gauge, Histogram};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::entry::{now_ms, Digest, Entry, EntryId};
use breaker::{Breaker, Permit, Transition};
use conn::{Conn, Connector};
pub use events::{ReplicationEvent, ReplicationStream};

/// Configuration of the Redis tier (the `[redis]` section).
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// Address of a single Redis server, e.g. `redis://127.0.0.1:6379` (credentials as
    /// `redis://user:password@host:port`). Absent, with `cluster_urls` empty: memory only.
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster; when non-empty, cluster mode is used and `url` ignored.
    pub cluster_urls: Vec<String>,
    /// Prefix of every key, so several deployments can share one Redis.
    pub prefix: String,
    /// Bound on each Redis command, milliseconds. A slower answer counts as a failure.
    pub timeout_ms: u64,
    /// Bound on establishing a connection, milliseconds.
    pub connect_timeout_ms: u64,
    /// Writes waiting for the background writer; beyond this they are dropped (and counted)
    /// rather than buffered without limit while Redis is slow.
    pub write_queue: usize,
    /// Consecutive failures (errors or timeouts) that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker fails calls fast before letting one probe through,
    /// milliseconds.
    pub breaker_cooldown_ms: u64,
    /// Approximate length the replication event stream is trimmed to (`XADD MAXLEN ~`).
    pub events_maxlen: usize,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: None,
            cluster_urls: Vec::new(),
            prefix: "reprise".into(),
            timeout_ms: 200,
            connect_timeout_ms: 1000,
            write_queue: 10_000,
            breaker_failures: 5,
            breaker_cooldown_ms: 2000,
            events_maxlen: 100_000,
        }
    }
}

impl RedisConfig {
    /// Whether a Redis tier is configured at all.
    pub fn is_enabled(&self) -> bool {
        self.url.is_some() || !self.cluster_urls.is_empty()
    }
}

// Written by hand so that passwords in urls never reach logs.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field(
                "cluster_urls",
                &self
                    .cluster_urls
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("prefix", &self.prefix)
            .field("timeout_ms", &self.timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("write_queue", &self.write_queue)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown_ms", &self.breaker_cooldown_ms)
            .field("events_maxlen", &self.events_maxlen)
            .finish()
    }
}

/// `redis://user:pass@host:6379/0` → `redis://***@host:6379/0`.
fn redact_url(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[start..];
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    match authority.rfind('@') {
        Some(at) => format!("{}***@{}", &url[..start], &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// Errors of the Redis tier. Callers treat every one as "no answer from L2" and carry on.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The configuration cannot be used (no url, unparsable url).
    #[error("redis configuration: {0}")]
    Config(String),
    /// The circuit breaker is open (or the tier is shutting down): not even tried.
    #[error("redis unavailable")]
    Unavailable,
    /// The command did not answer within `timeout_ms`.
    #[error("redis command timed out")]
    Timeout,
    /// Redis could not be reached or the connection broke.
    #[error("redis connection: {0}")]
    Connection(#[source] ::redis::RedisError),
    /// Redis answered with an error.
    #[error("redis command: {0}")]
    Command(#[source] ::redis::RedisError),
}

impl RedisError {
    /// Low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            RedisError::Config(_) => "config",
            RedisError::Unavailable => "unavailable",
            RedisError::Timeout => "timeout",
            RedisError::Connection(_) => "connection",
            RedisError::Command(_) => "command",
        }
    }
}

/// A snapshot of the tier's state, for health endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisHealth {
    /// The last command reached Redis and the breaker is closed.
    pub up: bool,
    /// Calls currently fail fast.
    pub breaker_open: bool,
    /// Writes waiting in the queue.
    pub queued_writes: usize,
    /// Writes dropped since start (queue full, breaker open, or failed).
    pub dropped_writes: u64,
}

/// Describes the tier's metrics to the recorder; call once at start-up.
pub fn describe_metrics() {
    describe_gauge!(
        "reprise_redis_up",
        "1 when the last Redis command succeeded."
    );
    describe_gauge!(
        "reprise_redis_breaker_open",
        "1 while the Redis circuit breaker fails calls fast."
    );
    describe_counter!(
        "reprise_redis_errors_total",
        "Redis operations that failed (errors, timeouts, open breaker), by operation."
    );
    describe_counter!(
        "reprise_redis_dropped_writes_total",
        "Redis writes dropped: queue full, breaker open or the write failed."
    );
    describe_counter!(
        "reprise_redis_skipped_total",
        "Values under the Redis prefix that could not be decoded and were ignored."
    );
    describe_histogram!(
        "reprise_redis_op_duration_seconds",
        metrics::Unit::Seconds,
        "Duration of Redis operations, by operation."
    );
}

/// Operations, as metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Get,
    GetByKey,
    Put,
    Alias,
    Delete,
    DeleteNamespace,
    DeleteTag,
    Scan,
    Events,
}

impl Op {
    const ALL: [Op; 9] = [
        Op::Get,
        Op::GetByKey,
        Op::Put,
        Op::Alias,
        Op::Delete,
        Op::DeleteNamespace,
        Op::DeleteTag,
        Op::Scan,
        Op::Events,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::GetByKey => "get_by_key",
            Op::Put => "put",
            Op::Alias => "alias",
            Op::Delete => "delete",
            Op::DeleteNamespace => "delete_namespace",
            Op::DeleteTag => "delete_tag",
            Op::Scan => "scan",
            Op::Events => "events",
        }
    }
}

/// Metric handles, created once per tier.
struct RedisMetrics {
    up: Gauge,
    breaker_open: Gauge,
    dropped: Counter,
    skipped: Counter,
    errors: [Counter; Op::ALL.len()],
    duration: [Histogram; Op::ALL.len()],
}

impl RedisMetrics {
    fn new() -> Self {
        RedisMetrics {
            up: metrics::gauge!("reprise_redis_up"),
            breaker_open: metrics::gauge!("reprise_redis_breaker_open"),
            dropped: metrics::counter!("reprise_redis_dropped_writes_total"),
            skipped: metrics::counter!("reprise_redis_skipped_total"),
            errors: Op::ALL
                .map(|op| metrics::counter!("reprise_redis_errors_total", "op" => op.as_str())),
            duration: Op::ALL.map(
                |op| metrics::histogram!("reprise_redis_op_duration_seconds", "op" => op.as_str()),
            ),
        }
    }

    fn errors(&self, op: Op) -> &Counter {
        &self.errors[op as usize]
    }

    fn duration(&self, op: Op) -> &Histogram {
        &self.duration[op as usize]
    }
}

/// Key names under the prefix.
#[derive(Debug, Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn entry(&self, id: EntryId) -> String {
        format!("{}:e:{{{id}}}", self.prefix)
    }

    fn key(&self, digest: &Digest) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 3 + 64);
        s.push_str(&self.prefix);
        s.push_str(":k:");
        for b in digest {
            // Writing into a String cannot fail.
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    fn namespace(&self, ns: &str) -> String {
        format!("{}:ns:{{{ns}}}", self.prefix)
    }

    fn tag(&self, tag: &str) -> String {
        format!("{}:tag:{{{tag}}}", self.prefix)
    }

    fn events(&self) -> String {
        format!("{}:events", self.prefix)
    }

    fn blob(&self, name: &str) -> String {
        format!("{}:blob:{{{name}}}", self.prefix)
    }

    /// SCAN pattern matching every entry key; glob characters of the prefix are escaped.
    fn entry_pattern(&self) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 4);
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                s.push('\\');
            }
            s.push(c);
        }
        s.push_str(":e:*");
        s
    }

    /// The id inside an entry key (`{prefix}:e:{<id>}`).
    fn id_of_entry_key(&self, key: &str) -> Option<EntryId> {
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix(":e:{")?;
        rest.strip_suffix('}')?.parse().ok()
    }
}

/// Version of the stored envelope; readers skip any other.
const ENVELOPE_VERSION: u32 = 1;

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    v: u32,
    entry: &'a Entry,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    v: u32,
    entry: Entry,
}

/// Adds an id to an index sorted set (score = its expiry), prunes expired ids and makes the
/// set outlive its longest-lived member. One script so the three steps see one state; it
/// touches a single key, so it runs on a cluster too. `PTTL` is -1 for a set without expiry,
/// which is below any TTL, so a fresh set always gets one.
const INDEX_SCRIPT: &str = "\
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1";

/// Writes taken from the queue at once; puts and aliases of one batch run concurrently.
const WRITE_BATCH: usize = 64;
/// Ids deleted per round of a namespace or tag delete.
const DELETE_BATCH: usize = 500;
/// Keys asked for per SCAN call.
const SCAN_COUNT: usize = 500;
/// A scan logs its progress every this many entries.
const SCAN_LOG_EVERY: usize = 10_000;
/// Deletes wait behind the writes queued before them (so an older pending put cannot bring
/// back what was just deleted); this many command timeouts bound the caller's wait.
const ADMIN_WAIT_FACTOR: u32 = 50;

/// What the write queue carries.
enum Queued {
    /// A put or alias; consecutive ones are applied concurrently.
    Write(Write),
    /// A delete or flush; applied alone, after everything queued before it.
    Admin(Admin),
}

/// A queued put or alias.
enum Write {
    Put {
        id: EntryId,
        namespace: String,
        expires_ms: u64,
        bytes: Vec<u8>,
        keys: Vec<Digest>,
        tags: Vec<String>,
    },
    Alias {
        key: Digest,
        id: EntryId,
        expires_ms: u64,
    },
    /// A named value without expiry (see [`RedisTier::put_blob`]).
    Blob { name: String, bytes: Vec<u8> },
}

/// A queued operation whose caller waits for the result.
enum Admin {
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
}

/// State shared by the handles and the background tasks.
struct Shared {
    keys: Keys,
    replica_id: String,
    timeout: Duration,
    connect_timeout: Duration,
    events_maxlen: usize,
    connector: Connector,
    /// Replaced on each half-open probe; a read lock per command to clone the handle.
    conn: RwLock<Conn>,
    breaker: Breaker,
    metrics: RedisMetrics,
    dropped: AtomicU64,
    up: AtomicBool,
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
            connector,
            conn: RwLock::new(conn),
            breaker: Breaker::new(
                cfg.breaker_failures,
                Duration::from_millis(cfg.breaker_cooldown_ms),
            ),
            metrics,
            dropped: AtomicU64::new(0),
            up: AtomicBool::new(false),
        });
        let (writes, rx) = mpsc::channel(cfg.write_queue.max(1));
        tokio::spawn(write_loop(shared.clone(), rx));
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
        let cmd = ::redis::cmd("GET").arg(&name).clone();
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
        let Some(raw) = raw else { return Ok(None) };
        let Some(id) = std::str::from_utf8(&raw)
            .ok()
            .and_then(|s| s.parse::<EntryId>().ok())
        else {
            self.shared.skip(&name, "not an entry id");
            return Ok(None);
        };
        self.shared.get(Op::GetByKey, id).await
    }

    /// An entry by id.
    pub async fn get(&self, id: EntryId) -> Result<Option<Entry>, RedisError> {
        self.shared.get(Op::Get, id).await
    }

    /// Queues an entry and the exact keys pointing at it, all expiring with the entry.
    /// Returns at once: `false` when the write was dropped (queue full, breaker open,
    /// entry already expired).
    pub fn put(&self, entry: &Entry, keys: &[Digest]) -> bool {
        self.put_with_tags(entry, keys, &[])
    }

    /// Like [`RedisTier::put`], also adding the entry to the given tags' indexes so that
    /// [`RedisTier::delete_tag`] can invalidate it.
    pub fn put_with_tags(&self, entry: &Entry, keys: &[Digest], tags: &[String]) -> bool {
        if entry.is_expired() {
            return false;
        }
        let envelope = EnvelopeOut {
            v: ENVELOPE_VERSION,
            entry,
        };
        let bytes = match serde_json::to_vec(&envelope) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, id = %entry.id, "redis: entry not serialisable");
                return false;
            }
        };
        self.enqueue(Write::Put {
            id: entry.id,
            namespace: entry.namespace.clone(),
            expires_ms: entry.expires_ms,
            bytes,
            keys: keys.to_vec(),
            tags: tags.to_vec(),
        })
    }

    /// Queues another exact key pointing at an existing entry, for `ttl`. Returns `false`
    /// when dropped.
    pub fn alias(&self, key: Digest, id: EntryId, ttl: Duration) -> bool {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ttl_ms == 0 {
            return false;
        }
        self.enqueue(Write::Alias {
            key,
            id,
            expires_ms: now_ms().saturating_add(ttl_ms),
        })
    }

    /// Queues a named value (e.g. learned state of a component) under the prefix, without
    /// expiry, replacing any earlier one. Returns `false` when the write was dropped.
    pub fn put_blob(&self, name: &str, bytes: Vec<u8>) -> bool {
        self.enqueue(Write::Blob {
            name: name.to_string(),
            bytes,
        })
    }

    /// The value stored by [`RedisTier::put_blob`] under `name`, if any.
    pub async fn get_blob(&self, name: &str) -> Result<Option<Vec<u8>>, RedisError> {
        let key = self.shared.keys.blob(name);
        let cmd = ::redis::cmd("GET").arg(&key).clone();
        match self
            .shared
            .run(Op::Get, |c| async move { c.query(&cmd).await })
            .await
        {
            Ok(raw) => Ok(raw),
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

    /// Waits until every write queued before this call has been applied (or dropped).
    pub async fn flush(&self) -> Result<(), RedisError> {
        self.admin(|reply| Admin::Flush { reply }).await
    }

    /// Every live entry (on a cluster, from every master), to rebuild a replica's indexes.
    /// `progress` is called with the running count after each batch. Undecodable values are
    /// skipped. Each command is bounded by `timeout_ms`; the scan as a whole is not.
    pub async fn scan_entries(&self, progress: impl Fn(usize)) -> Result<Vec<Entry>, RedisError> {
        let shared = &self.shared;
        let nodes = shared
            .run(Op::Scan, |c| async move { c.scan_nodes().await })
            .await?;
        let pattern = shared.keys.entry_pattern();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let mut next_log = SCAN_LOG_EVERY;
        for node in &nodes {
            let mut cursor: u64 = 0;
            loop {
                let cmd = ::redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT)
                    .clone();
                let (next, names): (u64, Vec<String>) = shared
                    .run(Op::Scan, |c| async move {
                        c.query_node(node.as_ref(), cmd).await
                    })
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
                    .filter(|(_, id)| seen.insert(*id))
                    .collect();
                let values = shared.get_many(Op::Scan, &names).await?;
                for ((name, id), raw) in names.iter().zip(values) {
                    if let Some(entry) = raw.and_then(|raw| shared.decode(name, *id, &raw)) {
                        out.push(entry);
                    }
                }
                progress(out.len());
                if out.len() >= next_log {
                    tracing::info!(entries = out.len(), "redis: scanning entries");
                    next_log += SCAN_LOG_EVERY;
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// The events other replicas publish. `from_last`: only events after now; otherwise the
    /// whole retained stream first. A background task reads with `XREAD BLOCK`, reconnects
    /// with backoff and emits [`ReplicationEvent::Resync`] when events may have been lost.
    /// Dropping the stream stops the task.
    pub fn subscribe(&self, from_last: bool) -> ReplicationStream {
        events::Subscriber {
            connector: self.shared.connector.clone(),
            stream_key: self.shared.keys.events(),
            replica_id: self.shared.replica_id.clone(),
            connect_timeout: self.shared.connect_timeout,
            timeout: self.shared.timeout,
            from_last,
            errors: self.shared.metrics.errors(Op::Events).clone(),
        }
        .spawn()
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

    /// Puts a write on the queue, or drops it.
    fn enqueue(&self, write: Write) -> bool {
        // While the breaker fails fast, queueing would only delay the drop.
        if self.shared.breaker.fails_fast() {
            self.shared.drop_write();
            return false;
        }
        match self.writes.try_send(Queued::Write(write)) {
            Ok(()) => true,
            Err(_) => {
                self.shared.drop_write();
                false
            }
        }
    }

    /// Sends an operation through the write queue and waits for its result.
    async fn admin<T>(
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
    /// Runs one operation through the breaker, bounded by the command timeout, with metrics.
    async fn run<T, F, Fut>(&self, op: Op, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = ::redis::RedisResult<T>>,
    {
        let Some(pass) = self.breaker.acquire() else {
            self.metrics.errors(op).increment(1);
            return Err(RedisError::Unavailable);
        };
        let permit = Permit::new(&self.breaker, pass);
        if permit.is_probe() {
            self.reconnect();
        }
        let conn = self.conn.read().clone();
        let start = Instant::now();
        let result = tokio::time::timeout(self.timeout, f(conn)).await;
        self.metrics
            .duration(op)
            .record(start.elapsed().as_secs_f64());
        let (reached, out) = match result {
            Ok(Ok(v)) => (true, Ok(v)),
            // Redis answered, with an error: the server is fine, the request was not.
            Ok(Err(e)) if !is_outage(&e) => (true, Err(RedisError::Command(e))),
            Ok(Err(e)) => (false, Err(RedisError::Connection(e))),
            Err(_) => (false, Err(RedisError::Timeout)),
        };
        let transition = permit.finish(reached);
        self.note(reached, transition);
        if let Err(e) = &out {
            self.metrics.errors(op).increment(1);
            tracing::debug!(op = op.as_str(), error = %e, "redis: operation failed");
        }
        out
    }

    /// Records whether Redis was reached and any breaker transition.
    fn note(&self, reached: bool, transition: Transition) {
        let was_up = self.up.swap(reached, Ordering::Relaxed);
        if was_up != reached {
            self.metrics.up.set(if reached { 1.0 } else { 0.0 });
        }
        match transition {
            Transition::Opened => {
                self.metrics.breaker_open.set(1.0);
                tracing::warn!("redis: circuit breaker open, failing fast");
            }
            Transition::Closed => {
                self.metrics.breaker_open.set(0.0);
                self.metrics.up.set(1.0);
                tracing::info!("redis: circuit breaker closed, redis is back");
            }
            Transition::None => {}
        }
    }

    /// Replaces the connection handle with a fresh lazy one (before a half-open probe).
    fn reconnect(&self) {
        match self.connector.connect(self.connect_timeout, self.timeout) {
            Ok(conn) => *self.conn.write() = conn,
            Err(e) => tracing::debug!(error = %e, "redis: cannot rebuild connection"),
        }
    }

    fn drop_write(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.metrics.dropped.increment(1);
    }

    /// Counts and logs a value that cannot be used.
    fn skip(&self, key: &str, why: &str) {
        self.metrics.skipped.increment(1);
        tracing::debug!(key, why, "redis: value skipped");
    }

    /// An entry by id (for either read operation's metrics).
    async fn get(&self, op: Op, id: EntryId) -> Result<Option<Entry>, RedisError> {
        let name = self.keys.entry(id);
        let cmd = ::redis::cmd("GET").arg(&name).clone();
        let raw: Option<Vec<u8>> = match self.run(op, |c| async move { c.query(&cmd).await }).await
        {
            Ok(raw) => raw,
            Err(e) if is_wrong_type(&e) => {
                self.skip(&name, "not a string");
                None
            }
            Err(e) => return Err(e),
        };
        Ok(raw.and_then(|raw| self.decode(&name, id, &raw)))
    }

    /// The values of several entry keys in one bounded round (concurrent GETs: on a cluster
    /// the keys are on different slots, so no MGET). A key holding a non-string reads as
    /// absent (skipped); any outage fails the whole round.
    async fn get_many(
        &self,
        op: Op,
        names: &[(String, EntryId)],
    ) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let results = self
            .run(op, |c| async move {
                let replies = join_all(names.iter().map(|(name, _)| {
                    let c = c.clone();
                    async move {
                        let cmd = ::redis::cmd("GET").arg(name).clone();
                        c.query::<Option<Vec<u8>>>(&cmd).await
                    }
                }))
                .await;
                if let Some(e) = replies
                    .iter()
                    .find_map(|r| r.as_ref().err().filter(|e| is_outage(e)))
                {
                    return Err(e.clone());
                }
                Ok(replies)
            })
            .await?;
        Ok(results
            .into_iter()
            .zip(names)
            .map(|(r, (name, _))| {
                r.unwrap_or_else(|_| {
                    self.skip(name, "not a string");
                    None
                })
            })
            .collect())
    }

    /// Decodes a stored envelope; anything unexpected is skipped.
    fn decode(&self, name: &str, id: EntryId, raw: &[u8]) -> Option<Entry> {
        match serde_json::from_slice::<EnvelopeIn>(raw) {
            Ok(env) if env.v != ENVELOPE_VERSION => {
                self.skip(name, "unknown envelope version");
                None
            }
            Ok(env) if env.entry.id != id => {
                self.skip(name, "entry id does not match its key");
                None
            }
            // Redis expires it at the same moment; clocks of replicas may differ slightly.
            Ok(env) if env.entry.is_expired() => None,
            Ok(env) => Some(env.entry),
            Err(_) => {
                self.skip(name, "not an entry envelope");
                None
            }
        }
    }

    /// An `XADD` of one event, trimmed approximately (`~` lets Redis trim whole nodes,
    /// which is much cheaper than an exact length).
    fn event(&self, op: &str, id: Option<EntryId>, namespace: &str) -> ::redis::Cmd {
        ::redis::cmd("XADD")
            .arg(self.keys.events())
            .arg("MAXLEN")
            .arg("~")
            .arg(self.events_maxlen)
            .arg("*")
            .arg("op")
            .arg(op)
            .arg("id")
            .arg(id.map(|id| id.to_string()).unwrap_or_default())
            .arg("ns")
            .arg(namespace)
            .arg("origin")
            .arg(&self.replica_id)
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

    async fn apply_write(&self, write: Write) -> Result<(), RedisError> {
        match write {
            Write::Put {
                id,
                namespace,
                expires_ms,
                bytes,
                keys,
                tags,
            } => {
                let now = now_ms();
                let ttl = expires_ms.saturating_sub(now);
                if ttl == 0 {
                    return Ok(());
                }
                let id_str = id.to_string();
                let mut cmds = Vec::with_capacity(keys.len() + tags.len() + 3);
                cmds.push(
                    ::redis::cmd("SET")
                        .arg(self.keys.entry(id))
                        .arg(bytes)
                        .arg("PX")
                        .arg(ttl)
                        .clone(),
                );
                for key in &keys {
                    cmds.push(
                        ::redis::cmd("SET")
                            .arg(self.keys.key(key))
                            .arg(&id_str)
                            .arg("PX")
                            .arg(ttl)
                            .clone(),
                    );
                }
                let index = |name: String| {
                    ::redis::cmd("EVAL")
                        .arg(INDEX_SCRIPT)
                        .arg(1)
                        .arg(name)
                        .arg(expires_ms)
                        .arg(&id_str)
                        .arg(now)
                        .arg(ttl)
                        .clone()
                };
                cmds.push(index(self.keys.namespace(&namespace)));
                for tag in &tags {
                    cmds.push(index(self.keys.tag(tag)));
                }
                cmds.push(self.event(events::OP_PUT, Some(id), &namespace));
                self.run(Op::Put, |c| run_all(c, cmds)).await.map(drop)
            }
            Write::Alias {
                key,
                id,
                expires_ms,
            } => {
                let ttl = expires_ms.saturating_sub(now_ms());
                if ttl == 0 {
                    return Ok(());
                }
                let cmd = ::redis::cmd("SET")
                    .arg(self.keys.key(&key))
                    .arg(id.to_string())
                    .arg("PX")
                    .arg(ttl)
                    .clone();
                self.run(Op::Alias, |c| async move { c.query::<Value>(&cmd).await })
                    .await
                    .map(drop)
            }
            Write::Blob { name, bytes } => {
                let cmd = ::redis::cmd("SET")
                    .arg(self.keys.blob(&name))
                    .arg(bytes)
                    .clone();
                self.run(Op::Put, |c| async move { c.query::<Value>(&cmd).await })
                    .await
                    .map(drop)
            }
        }
    }

    /// Applies a delete or flush and answers its caller.
    async fn apply_admin(&self, op: Admin) {
        match op {
            Admin::Delete { id, reply } => {
                let del = ::redis::cmd("DEL").arg(self.keys.entry(id)).clone();
                let event = self.event(events::OP_DEL, Some(id), "");
                let result = self
                    .run(Op::Delete, |c| async move {
                        let (n, _): (u64, Value) =
                            futures::try_join!(c.query(&del), c.query(&event))?;
                        Ok(n > 0)
                    })
                    .await;
                let _ = reply.send(result);
            }
            Admin::DeleteNamespace { namespace, reply } => {
                let index = self.keys.namespace(&namespace);
                let mut result = self
                    .delete_indexed(Op::DeleteNamespace, &index, false)
                    .await;
                if result.is_ok() {
                    let event = self.event(events::OP_DEL_NS, None, &namespace);
                    let sent = self
                        .run(Op::DeleteNamespace, |c| async move {
                            c.query::<Value>(&event).await
                        })
                        .await;
                    if let Err(e) = sent {
                        result = Err(e);
                    }
                }
                let _ = reply.send(result);
            }
            Admin::DeleteTag { tag, reply } => {
                let index = self.keys.tag(&tag);
                let _ = reply.send(self.delete_indexed(Op::DeleteTag, &index, true).await);
            }
            Admin::Flush { reply } => {
                let _ = reply.send(Ok(()));
            }
        }
    }

    /// Deletes the entries listed in an index sorted set, a batch at a time, removing them
    /// from the index as it goes (ids added meanwhile by concurrent puts stay). Returns how
    /// many entries were present. `per_entry_events`: publish a delete event per entry.
    async fn delete_indexed(
        &self,
        op: Op,
        index: &str,
        per_entry_events: bool,
    ) -> Result<u64, RedisError> {
        let mut deleted = 0;
        loop {
            let range = ::redis::cmd("ZRANGE")
                .arg(index)
                .arg(0)
                .arg(DELETE_BATCH - 1)
                .clone();
            let members: Vec<String> = self
                .run(op, |c| async move { c.query(&range).await })
                .await?;
            if members.is_empty() {
                return Ok(deleted);
            }
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
            cmds.push(::redis::cmd("ZREM").arg(index).arg(&members).clone());
            let replies = self.run(op, |c| run_all(c, cmds)).await;
            let replies = replies?;
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
async fn run_all(c: Conn, cmds: Vec<::redis::Cmd>) -> ::redis::RedisResult<Vec<Value>> {
    try_join_all(cmds.iter().map(|cmd| c.query::<Value>(cmd))).await
}

/// Applies queued writes until every [`RedisTier`] clone is dropped. Puts and aliases taken
/// together run concurrently; a delete or flush waits for the writes before it.
async fn write_loop(shared: Arc<Shared>, mut rx: mpsc::Receiver<Queued>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    let mut writes = Vec::new();
    while rx.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        for queued in batch.drain(..) {
            match queued {
                Queued::Write(write) => writes.push(write),
                Queued::Admin(admin) => {
                    shared.apply_writes(std::mem::take(&mut writes)).await;
                    shared.apply_admin(admin).await;
                }
            }
        }
        shared.apply_writes(std::mem::take(&mut writes)).await;
    }
}

/// Whether an error means Redis could not serve (counts against the breaker), as opposed to
/// Redis answering with an error about this request.
fn is_outage(e: &::redis::RedisError) -> bool {
    use ::redis::{ErrorKind, ServerErrorKind};
    match e.kind() {
        ErrorKind::Io | ErrorKind::ClusterConnectionNotFound | ErrorKind::AuthenticationFailed => {
            true
        }
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => true,
        _ => e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal(),
    }
}

/// Whether Redis refused the command because the key holds another type (a foreign value).
fn is_wrong_type(e: &RedisError) -> bool {
    matches!(e, RedisError::Command(e) if e.code() == Some("WRONGTYPE"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_redacts_credentials() {
        let cfg = RedisConfig {
            url: Some("redis://user:s3cret@10.0.0.1:6379/0".into()),
            cluster_urls: vec!["redis://:pw@h1:7000".into(), "redis://h2:7001".into()],
            ..RedisConfig::default()
        };
        let s = format!("{cfg:?}");
        assert!(!s.contains("s3cret") && !s.contains(":pw@"), "{s}");
        assert!(s.contains("redis://***@10.0.0.1:6379/0"), "{s}");
        assert!(s.contains("redis://h2:7001"), "{s}");
    }

    #[test]
    fn config_defaults_and_unknown_fields() {
        let cfg: RedisConfig = serde_json::from_str(r#"{"url":"redis://x"}"#).unwrap();
        assert_eq!(cfg.prefix, "reprise");
        assert_eq!(cfg.timeout_ms, 200);
        assert_eq!(cfg.write_queue, 10_000);
        assert!(serde_json::from_str::<RedisConfig>(r#"{"urll":"x"}"#).is_err());
    }

    #[test]
    fn key_names() {
        let keys = Keys {
            prefix: "p*x".into(),
        };
        let id = EntryId(0xab);
        let name = keys.entry(id);
        assert_eq!(name, "p*x:e:{000000000000000000000000000000ab}");
        assert_eq!(keys.id_of_entry_key(&name), Some(id));
        assert_eq!(keys.id_of_entry_key("p*x:e:{zz}"), None);
        assert_eq!(keys.key(&[0xff; 32]), format!("p*x:k:{}", "ff".repeat(32)));
        assert_eq!(keys.namespace("acme"), "p*x:ns:{acme}");
        assert_eq!(keys.entry_pattern(), "p\\*x:e:*");
    }
}
