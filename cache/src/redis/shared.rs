//! State shared by the [`RedisTier`](super::RedisTier) handles and the background tasks, and
//! the path every command takes: through the circuit breaker, bounded by the command
//! timeout, with metrics; and the reads built on it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::future::join_all;
use parking_lot::RwLock;

use super::breaker::{Breaker, Permit, Transition};
use super::conn::{Conn, Connector, Node};
use super::error::{first_outage, is_outage, is_wrong_type, RedisError};
use super::keys::Keys;
use super::metrics::{Op, RedisMetrics};
use crate::entry::{Entry, EntryId};

/// Reads a value only when it is at most `ARGV[1]` bytes long: returns the value, nil when
/// absent, or its length when longer (never sent). One key, so it runs on a cluster too.
pub(super) const CAPPED_GET: &str = "\
local n = redis.call('STRLEN', KEYS[1])
if n == 0 then return false end
if n > tonumber(ARGV[1]) then return n end
return redis.call('GET', KEYS[1])";

/// What [`CAPPED_GET`] answered.
pub(super) enum Capped {
    Value(Vec<u8>),
    Absent,
    TooLarge(i64),
}

impl ::redis::FromRedisValue for Capped {
    fn from_redis_value(v: ::redis::Value) -> Result<Self, ::redis::ParsingError> {
        match v {
            ::redis::Value::Nil => Ok(Capped::Absent),
            ::redis::Value::Int(n) => Ok(Capped::TooLarge(n)),
            other => Ok(Capped::Value(::redis::from_redis_value(other)?)),
        }
    }
}

/// State shared by the handles and the background tasks.
pub(super) struct Shared {
    pub(super) keys: Keys,
    pub(super) replica_id: String,
    pub(super) timeout: Duration,
    pub(super) connect_timeout: Duration,
    pub(super) events_maxlen: usize,
    /// Largest value read (see `RedisConfig::max_value_bytes`).
    pub(super) max_value_bytes: usize,
    pub(super) connector: Connector,
    /// Replaced on each half-open probe; a read lock per command to clone the handle.
    pub(super) conn: RwLock<Conn>,
    pub(super) breaker: Breaker,
    pub(super) metrics: RedisMetrics,
    pub(super) dropped: AtomicU64,
    pub(super) up: AtomicBool,
    /// Bytes of writes queued and not yet applied ([`super::writer`]), and their budget.
    pub(super) queued_bytes: AtomicU64,
    pub(super) queue_bytes: u64,
    /// Operations run (each one round trip: a command, a pipeline or a batch sent together).
    pub(super) rounds: AtomicU64,
    /// How long entries (and their keys and index entries) are kept past their expiry, to be
    /// served stale, milliseconds ([`super::RedisTier::retain_expired`]).
    pub(super) retain_ms: AtomicU64,
}

impl Shared {
    /// Until when (Unix milliseconds) something that expires at `expires_ms` is kept.
    pub(super) fn kept_until(&self, expires_ms: u64) -> u64 {
        expires_ms.saturating_add(self.retain_ms.load(Ordering::Relaxed))
    }
}

impl Shared {
    /// Runs one operation through the breaker, bounded by the command timeout, with metrics.
    pub(super) async fn run<T, F, Fut>(&self, op: Op, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = ::redis::RedisResult<T>>,
    {
        let Some(pass) = self.breaker.acquire() else {
            self.metrics.errors(op).increment(1);
            return Err(RedisError::Unavailable);
        };
        let permit = Permit::new(&self.breaker, pass);
        self.rounds.fetch_add(1, Ordering::Relaxed);
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

    pub(super) fn drop_write(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.metrics.dropped.increment(1);
    }

    /// One `SCAN` page on `node` (the only server when none) of the keys matching
    /// `pattern`, from `cursor`: the next cursor (0 at the end) and the names.
    pub(super) async fn scan_page(
        &self,
        op: Op,
        node: Option<&Node>,
        pattern: &str,
        cursor: u64,
    ) -> Result<(u64, Vec<String>), RedisError> {
        let scan = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(super::SCAN_COUNT)
            .clone();
        self.run(op, |c| async move { c.query_node(node, scan).await })
            .await
    }

    /// Counts and logs a value that cannot be used.
    pub(super) fn skip(&self, key: &str, why: &str) {
        self.metrics.skipped.increment(1);
        tracing::debug!(key, why, "redis: value skipped");
    }

    /// The `GET` of an entry key, unless the value is over the size cap.
    pub(super) fn capped_get(&self, name: &str) -> ::redis::Cmd {
        ::redis::cmd("EVAL")
            .arg(CAPPED_GET)
            .arg(1)
            .arg(name)
            .arg(self.max_value_bytes)
            .clone()
    }

    /// A capped read's value; one over the cap is absent (skipped and counted).
    pub(super) fn uncap(&self, name: &str, got: Capped) -> Option<Vec<u8>> {
        match got {
            Capped::Value(v) => Some(v),
            Capped::Absent => None,
            Capped::TooLarge(n) => {
                tracing::debug!(key = name, bytes = n, "redis: value over max_value_bytes");
                self.skip(name, "over max_value_bytes");
                None
            }
        }
    }

    /// An entry by id (for either read operation's metrics).
    pub(super) async fn get(&self, op: Op, id: EntryId) -> Result<Option<Entry>, RedisError> {
        let name = self.keys.entry(id);
        let cmd = self.capped_get(&name);
        let raw: Option<Vec<u8>> = match self
            .run(op, |c| async move { c.query::<Capped>(&cmd).await })
            .await
        {
            Ok(got) => self.uncap(&name, got),
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
    pub(super) async fn get_many(
        &self,
        op: Op,
        names: &[(String, EntryId)],
    ) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
        let results = self
            .each_key::<Capped>(op, names, |name| self.capped_get(name))
            .await?;
        Ok(results
            .into_iter()
            .zip(names)
            .map(|(r, (name, _))| match r {
                Ok(got) => self.uncap(name, got),
                Err(_) => {
                    self.skip(name, "not a string");
                    None
                }
            })
            .collect())
    }

    /// The lengths of string keys `names` (0 for an absent or non-string one), in one
    /// round of pipelined `STRLEN`s; any outage fails the whole round.
    pub(super) async fn lengths(
        &self,
        op: Op,
        names: &[(String, EntryId)],
    ) -> Result<Vec<u64>, RedisError> {
        let results = self
            .each_key::<u64>(op, names, |name| ::redis::cmd("STRLEN").arg(name).clone())
            .await?;
        Ok(results.into_iter().map(|r| r.unwrap_or(0)).collect())
    }

    /// The command `cmd` makes for each key of `names`, sent concurrently in one bounded
    /// round: each key's reply (a key of the wrong type is an error of its own); any outage
    /// fails the whole round.
    async fn each_key<T: ::redis::FromRedisValue + Send>(
        &self,
        op: Op,
        names: &[(String, EntryId)],
        cmd: impl Fn(&str) -> ::redis::Cmd + Sync,
    ) -> Result<Vec<::redis::RedisResult<T>>, RedisError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let cmd = &cmd;
        self.run(op, |c| async move {
            let replies = join_all(names.iter().map(|(name, _)| {
                let c = c.clone();
                let cmd = cmd(name);
                async move { c.query::<T>(&cmd).await }
            }))
            .await;
            first_outage(&replies)?;
            Ok(replies)
        })
        .await
    }
}
