//! The server's background work, started by [`start`] under one cancellation token and
//! stopped (and awaited) by [`BackgroundTasks::stop`]:
//!
//! - **prefetch**: learning follow-ups, prefetching, refresh-ahead ([`crate::prefetch`]);
//! - **replication**: this replica's memory, index and policies kept in step with Redis
//!   ([`crate::replication`]);
//! - **index maintenance**: partitions with many tombstones rebuilt every
//!   `semantic.maintain_interval_secs`;
//! - **snapshots**: without them a crash would lose everything since the start; every
//!   `cache.snapshot_interval_secs` the memory tier is saved to `cache.snapshot_path`
//!   ([`crate::snapshot`], written aside and renamed over the last);
//! - **stats**: just after each `stats.interval_secs`, the prefetcher's counters sampled into
//!   the interval that ended and, with Redis, the closed intervals published for the other
//!   replicas ([`crate::stats`]);
//! - **evidence**: with Redis, the verdicts behind learned thresholds shared with the other
//!   replicas every `semantic.evidence_sync_secs` ([`crate::bounds`]);
//! - **policy reload**: on `SIGHUP`, the configuration file's policy sections
//!   ([`crate::policy`]; with Redis, shared with the other replicas).
//!
//! Tasks hold the state weakly where they wait long, so a dropped server is never kept alive
//! by its own background work.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::state::AppState;

/// Handle to the running background tasks. Dropping it cancels them without waiting.
pub struct BackgroundTasks {
    stop: CancellationToken,
    tracker: TaskTracker,
}

/// Starts every background task the state's configuration calls for. With Redis, the
/// replication stream's start is resolved before it returns: requests served after it
/// cannot read an entry whose delete the stream then misses.
pub async fn start(state: &Arc<AppState>) -> BackgroundTasks {
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    if let Some(p) = &state.prefetch {
        if let Some(redis) = state.store.redis() {
            // Learned follow-ups are persisted with the cache and restored at start.
            p.attach_redis(redis.clone());
        }
        p.start(Arc::downgrade(state), &tracker, stop.clone());
    }
    if state.store.redis().is_some() {
        crate::replication::start(state, &tracker, stop.clone()).await;
    }
    if let Some(index) = state.store.index() {
        start_maintenance(state, index.clone(), &tracker, stop.clone());
    }
    let cache = &state.config.cache;
    if let Some(path) = cache.snapshot_path.clone() {
        // Interval 0: no periodic save, but deletes and refusals are still saved soon after.
        let every = (cache.snapshot_interval_secs > 0)
            .then(|| Duration::from_secs(cache.snapshot_interval_secs));
        start_snapshots(state, path, every, &tracker, stop.clone());
    }
    crate::stats::start(state, &tracker, stop.clone());
    crate::bounds::start(state, &tracker, stop.clone());
    if let Some(path) = state.config.source.clone() {
        start_reload_on_hangup(state, path, &tracker, stop.clone());
    }
    tracker.close();
    BackgroundTasks { stop, tracker }
}

impl BackgroundTasks {
    /// Cancels every task, waits until they ended, then saves what must survive a restart
    /// (the prefetcher's learned counts, when Redis holds them).
    pub async fn stop(self, state: &AppState) {
        self.stop.cancel();
        self.tracker.wait().await;
        if let (Some(p), Some(redis)) = (&state.prefetch, state.store.redis()) {
            if p.persist(redis) {
                // The save is queued like every Redis write: wait until it was applied.
                if let Err(e) = redis.flush().await {
                    tracing::warn!(error = %e, "prefetch counts not saved");
                } else {
                    tracing::info!("prefetch counts saved");
                }
            } else {
                tracing::warn!("prefetch counts not saved: the redis write was not queued");
            }
        }
    }
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Reads the configuration file again on `SIGHUP` and applies its policy sections
/// ([`crate::policy`]); an unreadable or invalid file changes nothing and is logged.
#[cfg(unix)]
fn start_reload_on_hangup(
    state: &Arc<AppState>,
    path: std::path::PathBuf,
    tracker: &TaskTracker,
    stop: CancellationToken,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; policies change only by the admin API");
            return;
        }
    };
    let weak = Arc::downgrade(state);
    tracker.spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                got = hangups.recv() => if got.is_none() { break },
            }
            let Some(state) = weak.upgrade() else { break };
            match reload(&state, &path).await {
                Ok(a) => tracing::info!(version = a.version, shared = a.shared, path = %path.display(), "SIGHUP: policies reloaded"),
                Err(e) => tracing::warn!(error = %format!("{e:#}"), path = %path.display(), "SIGHUP: policies not changed"),
            }
        }
    });
}

/// Applies the policy sections of the configuration file at `path`.
#[cfg(unix)]
async fn reload(
    state: &AppState,
    path: &std::path::Path,
) -> anyhow::Result<crate::policy::Applied> {
    let config = crate::config::Config::load(Some(path))?;
    crate::policy::apply(
        state,
        crate::policy::PolicyDocument::of_config(&config).whole(),
    )
    .await
}

#[cfg(not(unix))]
fn start_reload_on_hangup(
    _state: &Arc<AppState>,
    _path: std::path::PathBuf,
    _tracker: &TaskTracker,
    _stop: CancellationToken,
) {
}

/// Rebuilds index partitions that collected many tombstones (off the async workers: a
/// rebuild of a large partition takes a while): periodically, and as soon as a removal leaves
/// a partition worn past the rebuild ratio (the memory budget charges entries for at most
/// that share of tombstones).
fn start_maintenance(
    state: &Arc<AppState>,
    index: Arc<reprise_cache::semantic::SemanticIndex>,
    tracker: &TaskTracker,
    stop: CancellationToken,
) {
    let weak = Arc::downgrade(state);
    let every = Duration::from_secs(state.config.semantic.maintain_interval_secs.max(1));
    tracker.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
                _ = index.worn() => {}
            }
            let Some(state) = weak.upgrade() else { break };
            let store = state.store.clone();
            drop(state);
            let report = tokio::task::spawn_blocking(move || {
                let report = store.maintain();
                if report.is_some_and(|r| r.rebuilt > 0) {
                    release_free_memory();
                }
                report
            })
            .await;
            if let Ok(Some(r)) = report {
                if r.rebuilt > 0 {
                    tracing::info!(
                        rebuilt = r.rebuilt,
                        dropped = r.tombstones_dropped,
                        "index maintenance"
                    );
                }
            }
        }
    });
}

/// Hands the memory malloc holds free back to the system (glibc's `malloc_trim`). A rebuild
/// frees a whole graph at once (the new one was built beside it), and glibc keeps freed
/// memory for reuse: under churn RSS grew 27 MiB above the live heap in `reprise-bench soak
/// --semantic`, past every budget.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer; it walks malloc's own arenas under their locks and
    // returns whole free pages to the system.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Least time from one save to a save asked for by [`AppState::snapshot_wanted`]: a stream
/// of deletes or refusals is saved every few seconds, not by saves back to back.
const SNAPSHOT_GAP: Duration = Duration::from_secs(5);

/// How long a save asked for now waits: until [`SNAPSHOT_GAP`] has passed since the last
/// save began (`None`: no save yet).
fn snapshot_wait(last: Option<tokio::time::Instant>, now: tokio::time::Instant) -> Duration {
    last.map_or(Duration::ZERO, |last| {
        (last + SNAPSHOT_GAP).saturating_duration_since(now)
    })
}

/// Saves the memory tier to `path` every `every` (the first save one interval after the
/// start; `None`: never periodically), and soon after [`AppState::snapshot_wanted`] asks
/// (after a delete or a refusal: at once, or [`SNAPSHOT_GAP`] after the last save), off the
/// async workers; a save that failed is tried again [`SNAPSHOT_GAP`] after. One save at a
/// time, and the shutdown's own save comes after this task ended.
fn start_snapshots(
    state: &Arc<AppState>,
    path: std::path::PathBuf,
    every: Option<Duration>,
    tracker: &TaskTracker,
    stop: CancellationToken,
) {
    let weak = Arc::downgrade(state);
    let wanted = state.snapshot_wanted.clone();
    tracker.spawn(async move {
        let mut tick = every.map(|every| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        let mut last = None;
        loop {
            let periodic = async {
                match &mut tick {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = periodic => {}
                _ = wanted.notified() => {
                    let wait = snapshot_wait(last, tokio::time::Instant::now());
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    if let Some(t) = &mut tick {
                        t.reset();
                    }
                }
            }
            last = Some(tokio::time::Instant::now());
            let Some(state) = weak.upgrade() else { break };
            let p = path.clone();
            match tokio::task::spawn_blocking(move || crate::snapshot::save(&state, &p)).await {
                Ok(Ok(c)) => tracing::debug!(entries = c.entries, keys = c.keys, "snapshot saved"),
                // Tried again SNAPSHOT_GAP after this one (a full disk, say): a delete saved
                // only at the next period, or never with no period, would come back at the
                // restart.
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, path = %path.display(), "snapshot not saved; retrying");
                    wanted.notify_one();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "snapshot task failed; retrying");
                    wanted.notify_one();
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_asked_for_waits_out_the_gap_since_the_last() {
        let now = tokio::time::Instant::now();
        let secs = Duration::from_secs;
        assert_eq!(snapshot_wait(None, now), Duration::ZERO);
        assert_eq!(snapshot_wait(Some(now), now), SNAPSHOT_GAP);
        assert_eq!(
            snapshot_wait(Some(now), now + secs(2)),
            SNAPSHOT_GAP - secs(2)
        );
        assert_eq!(snapshot_wait(Some(now), now + SNAPSHOT_GAP), Duration::ZERO);
        assert_eq!(snapshot_wait(Some(now), now + secs(60)), Duration::ZERO);
    }
}
