//! The sweep of the index sets. Namespace and tag index sets never expire (so that a
//! `volatile-*` eviction policy never evicts one before the entries it lists, which a
//! namespace or tag delete would then miss); each put prunes the ids of its sets that are no
//! longer kept, and this sweep does the same for every set, deleting those left empty: a
//! namespace or tag that gets no more answers does not keep its set for good.
//!
//! One replica sweeps per interval (a lock key held for the interval), every master of a
//! cluster, one `SCAN` page at a time.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ::redis::Value;

use super::error::RedisError;
use super::metrics::Op;
use super::put::INDEX_MARGIN_MS;
use super::shared::Shared;
use super::writer::run_all;
use crate::entry::now_ms;

/// How often the index sets are swept (by one replica of all those sharing the Redis).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(600);

/// Prunes an index set's ids (and ended fence) no longer kept (`ARGV[1]`: now less
/// [`INDEX_MARGIN_MS`]); Redis deletes a sorted set left empty. Returns `{pruned, gone}`
/// (`gone` 1 when the set no longer exists: emptied here, or by a delete or a put since the
/// scan listed it), or `{-1, 0}` for a key that is not a sorted set (left alone). Also makes
/// a set an older version gave a TTL persistent. One key.
const SWEEP_SCRIPT: &str = "\
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'none' then return {0, 1} end
if t ~= 'zset' then return {-1, 0} end
local n = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return {n, 1} end
redis.call('PERSIST', KEYS[1])
return {n, 0}";

/// What a sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Index sets visited.
    pub sets: u64,
    /// Ids (and ended fences) taken out of them.
    pub pruned: u64,
    /// Sets left empty, so gone.
    pub deleted: u64,
}

impl Shared {
    /// Sweeps every namespace and tag index set once (see the [module](self)).
    pub(super) async fn sweep_indexes(&self) -> Result<Swept, RedisError> {
        let nodes = self
            .run(Op::Sweep, |c| async move { c.scan_nodes().await })
            .await?;
        let below = now_ms().saturating_sub(INDEX_MARGIN_MS);
        let mut swept = Swept::default();
        for pattern in self.keys.index_patterns() {
            for node in &nodes {
                let mut cursor: u64 = 0;
                loop {
                    let (next, names) = self
                        .scan_page(Op::Sweep, node.as_ref(), &pattern, cursor)
                        .await?;
                    let cmds: Vec<::redis::Cmd> = names
                        .iter()
                        .map(|name| {
                            ::redis::cmd("EVAL")
                                .arg(SWEEP_SCRIPT)
                                .arg(1)
                                .arg(name)
                                .arg(below)
                                .clone()
                        })
                        .collect();
                    let replies = self.run(Op::Sweep, |c| run_all(c, cmds)).await?;
                    for (name, reply) in names.iter().zip(replies) {
                        match ::redis::from_redis_value::<(i64, i64)>(reply) {
                            Ok((pruned, gone)) if pruned >= 0 => {
                                swept.sets += 1;
                                swept.pruned += pruned as u64;
                                swept.deleted += gone as u64;
                            }
                            _ => self.skip(name, "not an index set"),
                        }
                    }
                    cursor = next;
                    if cursor == 0 {
                        break;
                    }
                }
            }
        }
        Ok(swept)
    }

    /// Takes the sweep's lock for `hold` unless another replica holds it.
    async fn claim_sweep(&self, hold: Duration) -> Result<bool, RedisError> {
        let cmd = ::redis::cmd("SET")
            .arg(self.keys.sweep_lock())
            .arg(&self.replica_id)
            .arg("NX")
            .arg("PX")
            .arg(hold.as_millis().max(1) as u64)
            .clone();
        let reply = self
            .run(Op::Sweep, |c| async move { c.query::<Value>(&cmd).await })
            .await?;
        Ok(!matches!(reply, Value::Nil))
    }
}

/// Sweeps every [`SWEEP_INTERVAL`] (the first one a fraction of it after start, spread by
/// the replica's id so replicas started together do not race for the lock) while the tier
/// exists.
pub(super) async fn sweep_loop(shared: Weak<Shared>) {
    let first = {
        let Some(s) = shared.upgrade() else { return };
        let spread = blake3::hash(s.replica_id.as_bytes()).as_bytes()[0] as u32;
        SWEEP_INTERVAL / 2 + SWEEP_INTERVAL * spread / 512
    };
    tokio::time::sleep(first).await;
    loop {
        let Some(s) = shared.upgrade() else { return };
        sweep_once(&s).await;
        drop(s);
        tokio::time::sleep(SWEEP_INTERVAL).await;
    }
}

/// One round of [`sweep_loop`]: sweeps when this replica takes the lock.
async fn sweep_once(s: &Arc<Shared>) {
    match s.claim_sweep(SWEEP_INTERVAL).await {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::debug!(error = %e, "redis: index sweep skipped");
            return;
        }
    }
    let start = Instant::now();
    match s.sweep_indexes().await {
        Ok(swept) => tracing::info!(
            sets = swept.sets,
            pruned = swept.pruned,
            deleted = swept.deleted,
            secs = start.elapsed().as_secs_f64(),
            "redis: index sets swept"
        ),
        Err(e) => tracing::warn!(error = %e, "redis: index sweep failed; next interval"),
    }
}
