//! Keeping a replica in step with the shared Redis tier.
//!
//! Every replica consumes the tier's event stream: an entry another replica wrote is fetched
//! into this replica's memory and semantic index (so it becomes an exact *and* semantic hit
//! here); deletions are applied locally; a new version of the shared policies is applied
//! ([`crate::policy::sync`]). At start, and whenever the stream was missed (`Resync`), the
//! replica catches up with the shared policies and rebuilds from a scan of Redis in the
//! background, logging progress; exact hits keep being served from Redis meanwhile.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;
use reprise_cache::redis::{RedisTier, ReplicationEvent};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::state::AppState;

/// Wait before a second try of a catch-up or a policy read that Redis did not answer (the
/// first commands after Redis comes back may still fail, and its circuit breaker may still
/// be open); doubled for each further try, up to [`RETRY_MAX`]. They are tried until they
/// succeed, events applied in between: a replica that gave up would serve what other
/// replicas deleted, or keys they revoked, until the next event.
const RETRY_FIRST: Duration = Duration::from_millis(100);
/// Longest wait between two tries.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Starts the replication task of `state` (which must have a Redis tier), subscribed to the
/// stream (its start resolved) when this returns; it ends when `stop` is cancelled or the
/// state is dropped.
pub async fn start(state: &Arc<AppState>, tracker: &TaskTracker, stop: CancellationToken) {
    let Some(redis) = state.store.redis().cloned() else {
        return;
    };
    // Subscribed (its start resolved) before the rebuild and before any request is served,
    // so nothing written during or after the scan is missed, nor a delete of an entry a
    // request reads (a request served before the subscription could install an entry whose
    // delete event came before the stream's start).
    let mut events = redis.subscribe_from_now().await;
    let weak = Arc::downgrade(state);
    tracker.spawn(async move {
        // Redis's epoch as last seen: a different one at a resync means it lost its data.
        let mut epoch = None;
        // What is still to catch up with (at start: both), and when to try it next. A try
        // that Redis fails is made again later, and the events that arrive meanwhile are
        // applied in between.
        let mut owed = Owed {
            policies: true,
            rebuild: true,
        };
        let mut due = Some(tokio::time::Instant::now());
        let mut wait = RETRY_FIRST;
        loop {
            let ev = tokio::select! {
                _ = stop.cancelled() => break,
                _ = sleep_until(due), if due.is_some() => {
                    let tried = catch_up(&weak, &redis, &mut epoch, &mut owed);
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tried => {}
                    }
                    if weak.strong_count() == 0 {
                        break;
                    }
                    if owed.any() {
                        tracing::warn!(
                            retry_in_ms = wait.as_millis() as u64,
                            "catching up with redis failed; trying again"
                        );
                        due = Some(tokio::time::Instant::now() + wait);
                        wait = (wait * 2).min(RETRY_MAX);
                    } else {
                        (due, wait) = (None, RETRY_FIRST);
                    }
                    continue;
                }
                ev = events.next() => match ev {
                    Some(ev) => ev,
                    None => break,
                },
            };
            let Some(state) = weak.upgrade() else { break };
            let store = &state.store;
            match ev {
                ReplicationEvent::Put { id, .. } => {
                    if let Ok(Some(entry)) = redis.get(id).await {
                        store.install(entry).await;
                    }
                }
                ReplicationEvent::Delete { id } => store.remove_local(id).await,
                ReplicationEvent::DeleteNamespace { namespace } => {
                    store.remove_local_namespace(&namespace).await;
                }
                // Besides each entry's own delete event: the fence, and what this replica
                // holds with the tag that Redis never had (a put dropped or still queued).
                ReplicationEvent::DeleteTag { tag } => {
                    store.remove_local_tag(&tag).await;
                }
                ReplicationEvent::DeleteTagWithin { prefix, tag } => {
                    store.remove_local_tag_within(&prefix, &tag).await;
                }
                // Besides each entry's own delete event: the fence, and what this replica
                // holds that Redis never had, dropped at once and then deleted through the
                // write queue, so a put of one still queued here is applied first and then
                // deleted (and its id marked against a later one).
                ReplicationEvent::DeleteWhere {
                    scope,
                    model,
                    created_until_ms,
                } => {
                    let selection = crate::admin::Selection {
                        tenant: scope,
                        model,
                        created_until_ms,
                    };
                    store.fence_where(selection.delete_filter());
                    let ids: Vec<_> = store
                        .entries()
                        .into_iter()
                        .filter(|e| selection.matches(e))
                        .map(|e| e.id)
                        .collect();
                    for id in &ids {
                        store.remove_local(*id).await;
                    }
                    let redis = redis.clone();
                    tokio::spawn(async move {
                        for id in ids {
                            if let Err(e) = redis.delete(id).await {
                                tracing::warn!(error = %e, "a filtered delete's entry not deleted in redis");
                                break;
                            }
                        }
                    });
                }
                ReplicationEvent::Policies { .. } => {
                    owed.policies = true;
                    due = Some(tokio::time::Instant::now());
                }
                ReplicationEvent::Resync => {
                    owed = Owed {
                        policies: true,
                        rebuild: true,
                    };
                    due = Some(tokio::time::Instant::now());
                }
            }
        }
    });
}

/// What a replica still has to catch up with.
struct Owed {
    /// The shared policies (a policy event, a gap).
    policies: bool,
    /// The entries (a gap, the start).
    rebuild: bool,
}

impl Owed {
    fn any(&self) -> bool {
        self.policies || self.rebuild
    }
}

/// Sleeps until `due` (for ever without one).
async fn sleep_until(due: Option<tokio::time::Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One try at what is `owed`: the shared policies, applied if they are newer (a version
/// published before the subscription, or while events were missed), then the rebuild; what
/// went through is cleared (the caller tries the rest again later: the events a rebuild
/// stands for are gone from the stream, so giving up would leave deletes and revoked keys
/// unapplied).
async fn catch_up(
    weak: &Weak<AppState>,
    redis: &RedisTier,
    epoch: &mut Option<String>,
    owed: &mut Owed,
) {
    if owed.policies {
        let Some(state) = weak.upgrade() else { return };
        owed.policies = !crate::policy::sync(&state).await;
    }
    if owed.rebuild {
        owed.rebuild = !rebuild(weak, redis, epoch).await;
    }
}

/// Drops what Redis no longer holds (deletes this replica may have missed), then loads every
/// live entry from Redis into memory and the index. When Redis lost its data since the last
/// look (its epoch changed: a restart without persistence), nothing it lacks was deleted:
/// this replica writes what it holds back instead of dropping it. Whether it went through
/// (`false`: Redis failed a step; the caller tries again).
async fn rebuild(weak: &Weak<AppState>, redis: &RedisTier, epoch: &mut Option<String>) -> bool {
    let started = std::time::Instant::now();
    tracing::info!("rebuilding the index from redis");
    let now = match redis.epoch().await {
        Ok(now) => now,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read redis's epoch");
            return false;
        }
    };
    let wiped = matches!(&*epoch, Some(before) if *before != now);
    if let Some(state) = weak.upgrade() {
        if wiped {
            match state.store.reseed().await {
                Ok(n) => tracing::warn!(
                    entries = n,
                    "redis lost its data; wrote back what this replica holds"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "could not write entries back to redis");
                    return false;
                }
            }
        } else {
            match state.store.drop_absent().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(entries = n, "dropped entries deleted in redis meanwhile"),
                Err(e) => {
                    tracing::warn!(error = %e, "could not check held entries against redis");
                    return false;
                }
            }
        }
    }
    // Only once what it stands for is done: a failed write-back is tried again as one.
    *epoch = Some(now);
    let Some(state) = weak.upgrade() else {
        return true;
    };
    // Streamed: one page of entries at a time from Redis into memory, up to what memory
    // holds (the rest stays in Redis, found there on demand).
    let (pages, receive) = tokio::sync::mpsc::channel(2);
    let scan = redis.scan_pages(pages, |n| {
        tracing::info!(entries = n, "index rebuild: scanned")
    });
    let load = state.store.load_pages(receive, |done| {
        tracing::info!(done, "index rebuild: loaded into memory")
    });
    let (scanned, loaded) = tokio::join!(scan, load);
    let total = match scanned {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "index rebuild from redis failed");
            return false;
        }
    };
    if loaded.stopped_at_budget {
        tracing::warn!(
            loaded = loaded.entries,
            "index rebuild stopped at the memory budget (cache.memory_bytes); the rest stays in redis"
        );
        state.metrics.rebuild_stopped_at_budget();
    }
    state
        .rebuilds
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tracing::info!(
        entries = total,
        vectors = loaded.vectors,
        seconds = started.elapsed().as_secs_f64(),
        "index rebuilt from redis"
    );
    true
}
