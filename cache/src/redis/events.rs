//! Replication events: what one replica tells the others through the `{prefix}:events` stream.
//!
//! Every put, delete and namespace delete is appended (XADD, capped with `MAXLEN ~`) with the
//! writer's replica id, so each replica can keep its in-process tiers (memory, semantic index)
//! in step with the shared Redis tier and skip its own events. A new version of the shared
//! policies is announced the same way. A reader that may have missed events is told so with
//! [`ReplicationEvent::Resync`] and rebuilds from a full scan.
//!
//! Missed events are found on every read, not only after a connection error: each read is
//! one script ([`READ_SCRIPT`]) that returns the stream's `max-deleted-entry-id` (Redis 7;
//! the first entry's id on older servers) and last id together with the events after the
//! reader's position, in one atomic step. An entry after the position that was trimmed away
//! (a reader that fell behind by more than `MAXLEN`) or a stream that is gone or went back
//! (Redis restarted without it) is a gap. A reader that was disconnected also compares the
//! stream's ends with its position when it is back (a restart may have recreated the stream
//! with newer ids).

use std::fmt;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};
use std::time::Duration;

use ::redis::streams::{StreamId, StreamRangeReply, StreamReadReply};
use futures::Stream;
use tokio::sync::mpsc;

use super::conn::{Conn, Connector};
use super::RedisError;
use crate::entry::EntryId;

/// One change made by another replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationEvent {
    /// An entry was stored; fetch it with [`super::RedisTier::get`].
    Put {
        /// The entry's id.
        id: EntryId,
        /// Its namespace.
        namespace: String,
    },
    /// An entry was deleted.
    Delete {
        /// The entry's id.
        id: EntryId,
    },
    /// Every entry of a namespace was deleted.
    DeleteNamespace {
        /// The namespace.
        namespace: String,
    },
    /// Every entry with a tag was deleted (each also has its own [`ReplicationEvent::Delete`]).
    DeleteTag {
        /// The tag.
        tag: String,
    },
    /// Every entry with a tag in the namespaces starting with a prefix (one tenant's) is
    /// being deleted, entry by entry (each with its own [`ReplicationEvent::Delete`]).
    DeleteTagWithin {
        /// The namespaces' prefix.
        prefix: String,
        /// The tag.
        tag: String,
    },
    /// Every entry a filter selects is being deleted, entry by entry (each with its own
    /// [`ReplicationEvent::Delete`]): an operator's filtered delete. A replica drops what it
    /// holds that the filter selects, answers whose puts never reached Redis included.
    /// Every field given must match; what `scope` names is the server's (a tenant).
    DeleteWhere {
        /// The tenant whose entries are selected (empty: the anonymous tenant's).
        scope: Option<String>,
        /// The model whose entries are selected.
        model: Option<String>,
        /// Entries created at or before this time, Unix milliseconds, are selected.
        created_until_ms: Option<u64>,
    },
    /// A new version of the shared policies was stored; read it with
    /// [`super::RedisTier::get_policies`] (a later one may have replaced it meanwhile).
    Policies {
        /// The version announced.
        version: u64,
    },
    /// Events may have been missed: rebuild from [`super::RedisTier::scan_entries`]. Events
    /// after this one continue from the stream's position at the time of the resync.
    Resync,
}

/// Stream field values of the `op` field.
pub(crate) const OP_PUT: &str = "put";
pub(crate) const OP_DEL: &str = "del";
pub(crate) const OP_DEL_NS: &str = "del_ns";
pub(crate) const OP_DEL_TAG: &str = "del_tag";
/// A tag deleted within the namespaces of a prefix (`ns`): a replica of an earlier release
/// skips the unknown op rather than taking it for a delete of the tag everywhere.
pub(crate) const OP_DEL_TAG_WITHIN: &str = "del_tag_in";
pub(crate) const OP_POLICIES: &str = "policies";
/// A filtered delete (a replica of an earlier release skips the unknown op).
pub(crate) const OP_DEL_WHERE: &str = "del_where";

/// One read: the stream's state and the events after position `ARGV[2]` (at most `ARGV[1]`),
/// atomically, so that a trim cannot fall between the check and the read. Returns
/// `{exists, last-generated-id, max-deleted-entry-id, first id, length, events}`;
/// `max-deleted` (events removed by `XDEL`) is `0-0` when the server does not report it
/// (before Redis 7). One key, so it runs on a cluster too.
const READ_SCRIPT: &str = "\
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, '0-0', '0-0', '0-0', 0, {}} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local last, deleted, length = '0-0', '0-0', 0
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then last = info[i + 1]
  elseif info[i] == 'max-deleted-entry-id' then deleted = info[i + 1]
  elseif info[i] == 'length' then length = info[i + 1] end
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local first_id = '0-0'
if #first > 0 then first_id = first[1][1] end
local events = redis.call('XRANGE', KEYS[1], '(' .. ARGV[2], '+', 'COUNT', ARGV[1])
return {1, last, deleted, first_id, length, events}";

/// How long one XREAD blocks waiting for new events.
const BLOCK: Duration = Duration::from_millis(1000);
/// Events fetched per XREAD.
const READ_COUNT: usize = 256;
/// Reconnect backoff bounds.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Events buffered between the reader task and the consumer; when full the reader waits,
/// which is the backpressure we want (the stream keeps the rest in Redis).
const CHANNEL: usize = 1024;

/// A position in a Redis stream (`<ms>-<seq>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct StreamPos(u64, u64);

impl StreamPos {
    const ZERO: StreamPos = StreamPos(0, 0);
}

impl FromStr for StreamPos {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        let (ms, seq) = s.split_once('-').ok_or(())?;
        Ok(StreamPos(
            ms.parse().map_err(|_| ())?,
            seq.parse().map_err(|_| ())?,
        ))
    }
}

impl fmt::Display for StreamPos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// The events of other replicas, as a [`Stream`]. Dropping it stops the reader task.
pub struct ReplicationStream {
    rx: mpsc::Receiver<ReplicationEvent>,
}

impl Stream for ReplicationStream {
    type Item = ReplicationEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

/// Everything the reader task needs; it owns its own connection because a blocking XREAD
/// would stall every other command multiplexed on a shared one.
pub(crate) struct Subscriber {
    pub(crate) connector: Connector,
    pub(crate) stream_key: String,
    pub(crate) replica_id: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) timeout: Duration,
    pub(crate) from_last: bool,
    /// `reprise_redis_errors_total{op="events"}`.
    pub(crate) errors: metrics::Counter,
    /// Where to start, resolved before the task started ([`Subscriber::resolve_start`]);
    /// `None`: resolved by the task when it first reaches Redis.
    pub(crate) start: Option<StreamPos>,
    /// Resolving the start failed before the task started.
    pub(crate) start_failed: bool,
    /// The connection that resolved the start, which the task reads on.
    pub(crate) conn: Option<Conn>,
}

/// Where the reader stands.
struct ReadState {
    /// Last event seen; `None` until the start position is resolved.
    cursor: Option<StreamPos>,
    /// The connection failed since the last successful read: check for a gap before reading.
    lost: bool,
    /// Resolving the start position failed at least once (Redis was down at subscription).
    start_failed: bool,
}

impl Subscriber {
    /// Resolves where to start now (the newest event, with `from_last`), so that every event
    /// written after this returns is delivered; when Redis cannot be reached, the task
    /// resolves it later and reports a [`ReplicationEvent::Resync`] first.
    pub(crate) async fn resolve_start(&mut self) {
        // Made as the task makes its own (its reads block), and handed to it.
        let conn = self
            .connector
            .connect(self.connect_timeout, BLOCK + self.timeout);
        let start = match &conn {
            Ok(c) if self.from_last => self.last(c).await.map(|p| p.unwrap_or(StreamPos::ZERO)),
            Ok(_) => Ok(StreamPos::ZERO),
            Err(e) => Err(RedisError::Connection(e.clone())),
        };
        match start {
            Ok(p) => {
                self.start = Some(p);
                self.conn = conn.ok();
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis events: start not resolved yet");
                self.errors.increment(1);
                self.start_failed = true;
            }
        }
    }

    /// Starts the reader task and returns its stream.
    pub(crate) fn spawn(self) -> ReplicationStream {
        let (tx, rx) = mpsc::channel(CHANNEL);
        tokio::spawn(self.run(tx));
        ReplicationStream { rx }
    }

    async fn run(self, tx: mpsc::Sender<ReplicationEvent>) {
        let mut conn: Option<Conn> = self.conn.clone();
        let mut state = ReadState {
            cursor: self.start,
            lost: false,
            start_failed: self.start_failed,
        };
        let mut backoff = MIN_BACKOFF;
        loop {
            let result = match &conn {
                Some(c) => {
                    let c = c.clone();
                    tokio::select! {
                        _ = tx.closed() => return,
                        r = self.step(&c, &mut state) => r,
                    }
                }
                // The reply of a blocking read may take BLOCK plus the usual command time.
                None => match self
                    .connector
                    .connect(self.connect_timeout, BLOCK + self.timeout)
                {
                    Ok(c) => {
                        conn = Some(c);
                        continue;
                    }
                    Err(e) => Err(RedisError::Connection(e)),
                },
            };
            match result {
                Ok(events) => {
                    backoff = MIN_BACKOFF;
                    for event in events {
                        if tx.send(event).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "redis events: read failed, reconnecting");
                    self.errors.increment(1);
                    // A fresh connection on the next turn; the redis-rs handle might keep
                    // waiting on a dead socket otherwise.
                    conn = None;
                    if state.cursor.is_some() {
                        state.lost = true;
                    } else {
                        state.start_failed = true;
                    }
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// One turn: resolve the start or check for a gap when needed, then one blocking read.
    async fn step(
        &self,
        conn: &Conn,
        state: &mut ReadState,
    ) -> Result<Vec<ReplicationEvent>, RedisError> {
        let mut events = Vec::new();
        match state.cursor {
            None => {
                let start = if self.from_last {
                    self.last(conn).await?.unwrap_or(StreamPos::ZERO)
                } else {
                    StreamPos::ZERO
                };
                state.cursor = Some(start);
                // Whatever happened while Redis could not be reached is unknown to the caller.
                if state.start_failed && self.from_last {
                    events.push(ReplicationEvent::Resync);
                }
            }
            Some(cursor) if state.lost => {
                let first = self.first(conn).await?;
                let last = self.last(conn).await?;
                let gap = match (first, last) {
                    // No stream after a lost connection: Redis restarted without it, or it
                    // never held one. A reader that had read nothing yet cannot tell the two
                    // apart; a resync on an empty Redis costs an empty scan, a missed one
                    // leaves a wiped Redis unrefilled.
                    (None, _) | (_, None) => true,
                    // Trimmed past our position, or recreated with smaller ids.
                    (Some(first), Some(last)) => first > cursor || last < cursor,
                };
                if gap {
                    tracing::info!("redis events: possible gap after reconnect, resyncing");
                    state.cursor = Some(last.unwrap_or(StreamPos::ZERO));
                    events.push(ReplicationEvent::Resync);
                }
                state.lost = false;
            }
            Some(_) => {}
        }
        if !events.is_empty() {
            // The resync goes out now: a read after it that failed would drop it with this
            // turn's events, and the position it moved to shows no gap any more.
            return Ok(events);
        }
        let cursor = state.cursor.unwrap_or(StreamPos::ZERO);
        let read = ::redis::cmd("EVAL")
            .arg(READ_SCRIPT)
            .arg(1)
            .arg(&self.stream_key)
            .arg(READ_COUNT)
            .arg(cursor.to_string())
            .clone();
        let (exists, last, deleted, first, length, items): (
            i64,
            String,
            String,
            String,
            u64,
            StreamRangeReply,
        ) = self.bounded(conn, &read, Duration::ZERO).await?;
        let pos = |s: &str| s.parse::<StreamPos>().unwrap_or(StreamPos::ZERO);
        let (last, deleted, first) = (pos(&last), pos(&deleted), pos(&first));
        if cursor != StreamPos::ZERO {
            let gap = if exists == 0 {
                // Gone (deleted, or Redis restarted without it) though we had read some.
                true
            } else if last < cursor {
                // Recreated with smaller ids.
                true
            } else if deleted > cursor {
                // An event after our position was deleted (`XDEL`) before we read it.
                true
            } else if length == 0 {
                // Trimmed empty: anything written after our position is gone.
                last > cursor
            } else {
                // Trimmed from the start: the oldest event left is after ours, so events
                // between may have gone (or only ours did: a resync too many, never one too
                // few; a reader that keeps up holds a position near the newest event, far
                // from the trimmed end).
                first > cursor
            };
            if gap {
                tracing::info!(
                    cursor = %cursor,
                    "redis events: the stream was trimmed past this reader, resyncing"
                );
                // The rebuild reads the state as of now; events after `last` follow it.
                state.cursor = Some(last);
                events.push(ReplicationEvent::Resync);
                return Ok(events);
            }
        }
        if items.ids.is_empty() {
            // Nothing new: wait for the next event (what the wait returns is read again, with
            // the check, on the next turn).
            let wait = ::redis::cmd("XREAD")
                .arg("COUNT")
                .arg(1)
                .arg("BLOCK")
                .arg(BLOCK.as_millis() as u64)
                .arg("STREAMS")
                .arg(&self.stream_key)
                .arg(cursor.to_string())
                .clone();
            let _: Option<StreamReadReply> = self.bounded(conn, &wait, BLOCK).await?;
            return Ok(events);
        }
        for item in items.ids {
            if let Ok(pos) = item.id.parse() {
                state.cursor = Some(pos);
            }
            if let Some(event) = self.decode(&item) {
                events.push(event);
            }
        }
        Ok(events)
    }

    /// The oldest event's position.
    async fn first(&self, conn: &Conn) -> Result<Option<StreamPos>, RedisError> {
        let cmd = ::redis::cmd("XRANGE")
            .arg(&self.stream_key)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .clone();
        let reply: StreamRangeReply = self.bounded(conn, &cmd, Duration::ZERO).await?;
        Ok(reply.ids.first().and_then(|i| i.id.parse().ok()))
    }

    /// The newest event's position.
    async fn last(&self, conn: &Conn) -> Result<Option<StreamPos>, RedisError> {
        let cmd = ::redis::cmd("XREVRANGE")
            .arg(&self.stream_key)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .clone();
        let reply: StreamRangeReply = self.bounded(conn, &cmd, Duration::ZERO).await?;
        Ok(reply.ids.first().and_then(|i| i.id.parse().ok()))
    }

    /// A command bounded by the configured timeout plus `extra` (the block time of a read).
    async fn bounded<T: ::redis::FromRedisValue>(
        &self,
        conn: &Conn,
        cmd: &::redis::Cmd,
        extra: Duration,
    ) -> Result<T, RedisError> {
        match tokio::time::timeout(self.timeout + extra, conn.query(cmd)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(RedisError::Connection(e)),
            Err(_) => Err(RedisError::Timeout),
        }
    }

    /// The event an item stands for, unless it is ours or not understood.
    fn decode(&self, item: &StreamId) -> Option<ReplicationEvent> {
        let origin: String = item.get("origin").unwrap_or_default();
        if origin == self.replica_id {
            return None;
        }
        let op: String = item.get("op")?;
        let id = || item.get::<String>("id").and_then(|s| s.parse().ok());
        let namespace = || item.get::<String>("ns");
        let event = match op.as_str() {
            OP_PUT => ReplicationEvent::Put {
                id: id()?,
                namespace: namespace()?,
            },
            OP_DEL => ReplicationEvent::Delete { id: id()? },
            OP_DEL_NS => ReplicationEvent::DeleteNamespace {
                namespace: namespace()?,
            },
            OP_DEL_TAG => ReplicationEvent::DeleteTag {
                tag: item.get::<String>("tag")?,
            },
            OP_DEL_TAG_WITHIN => ReplicationEvent::DeleteTagWithin {
                prefix: namespace().filter(|p| !p.is_empty())?,
                tag: item.get::<String>("tag")?,
            },
            OP_POLICIES => ReplicationEvent::Policies {
                version: item.get::<String>("version")?.parse().ok()?,
            },
            OP_DEL_WHERE => {
                let until = match item.get::<String>("until") {
                    Some(s) => Some(s.parse().ok()?),
                    None => None,
                };
                let (scope, model) = (item.get::<String>("scope"), item.get::<String>("model"));
                // A filter that selects everything is no filter: never taken for one.
                if scope.is_none() && model.is_none() && until.is_none() {
                    return None;
                }
                ReplicationEvent::DeleteWhere {
                    scope,
                    model,
                    created_until_ms: until,
                }
            }
            other => {
                tracing::debug!(op = other, id = %item.id, "redis events: unknown op skipped");
                return None;
            }
        };
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_positions_order_numerically() {
        let a: StreamPos = "1700000000000-9".parse().unwrap();
        let b: StreamPos = "1700000000000-10".parse().unwrap();
        let c: StreamPos = "1700000000001-0".parse().unwrap();
        assert!(a < b && b < c);
        assert_eq!(b.to_string(), "1700000000000-10");
        assert!("nope".parse::<StreamPos>().is_err());
    }
}
