//! What the served traffic adds up to, per interval: the data behind `GET /admin/stats`
//! and `reprise report`.
//!
//! - [`rollup`]: a [`Rollup`] sums the requests of one interval (by outcome, tier and tenant,
//!   latency and TTFT histograms of fixed buckets ([`hist`]), savings, gate rejections, the
//!   most missed questions and most served pairs ([`topk`], Space-Saving)); merging two is
//!   adding them, so intervals and replicas combine exactly.
//! - [`ring`]: this replica's latest `[stats] intervals` intervals of `interval_secs`, each
//!   with the all-tenant rollup and one per tenant, within `memory_bytes`. Every finished
//!   client request is added once, from `Drop for Bookkeeping`, with its request-log record
//!   (a lock held for the add: a few counters and at most two list scans of 50).
//! - [`shared`]: with Redis, each replica publishes its closed intervals under its replica id
//!   (one hash per interval, living as long as the ring spans); a view merges every replica's
//!   rollups of each interval with its own.
//! - [`view`]: the JSON of `GET /admin/stats`.
//! - [`report`]: `reprise report`, the same rollups folded from a request log file, as
//!   markdown or a self-contained HTML page ([`html`]: tables and inline SVG charts).
//!
//! A background task ([`start`]) wakes just after each interval ends: it samples the
//! prefetcher's totals into the interval (the prefetcher counts for every tenant, so only the
//! all-tenant rollup has them) and publishes what closed. On shutdown it publishes the open
//! interval too.

pub mod hist;
pub mod html;
pub mod report;
pub mod ring;
pub mod rollup;
mod shared;
pub mod topk;
mod view;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use reprise_cache::now_ms;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::StatsConfig;
use crate::reqlog::LogRecord;
use crate::state::AppState;
pub use ring::{Bounds, Interval, Ring};
pub use rollup::{Facts, PrefetchCounts, Rollup};
pub use view::view;

/// The stats of this replica: its ring of intervals.
pub struct Stats {
    enabled: bool,
    ring: Mutex<Ring>,
}

impl Stats {
    /// An empty ring with the bounds of `[stats]`.
    pub fn new(cfg: &StatsConfig) -> Stats {
        Stats {
            enabled: cfg.enabled,
            ring: Mutex::new(Ring::new(Bounds {
                interval_ms: cfg.interval_secs.saturating_mul(1000),
                intervals: cfg.intervals,
                memory_bytes: cfg.memory_bytes,
                tenants: cfg.tenants,
            })),
        }
    }

    /// Counts a finished client request.
    pub fn record(&self, rec: &LogRecord) {
        if self.enabled {
            self.ring.lock().add(rec);
        }
    }

    /// Whether rollups are kept.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The ring (held briefly: requests add to it when they end).
    pub fn ring(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock()
    }
}

/// The prefetcher's totals since start (zeros without prefetch).
fn prefetch_totals(state: &AppState) -> PrefetchCounts {
    state
        .prefetch
        .as_ref()
        .map_or_else(PrefetchCounts::default, |p| {
            let s = p.stats();
            PrefetchCounts {
                // Refresh-ahead renewals are never counted used nor wasted: left out, so
                // the share used and the share wasted are of prefetched answers.
                completed: s.completed.saturating_sub(s.refreshed),
                hits: s.hits,
                wasted: s.wasted,
            }
        })
}

/// Starts the task that closes intervals: samples the prefetcher's totals and publishes
/// closed intervals to Redis just after each interval ends, and the open one on shutdown.
pub fn start(state: &Arc<AppState>, tracker: &TaskTracker, stop: CancellationToken) {
    if !state.stats.enabled() {
        return;
    }
    let interval_ms = state.config.stats.interval_secs.saturating_mul(1000).max(1);
    // Just after the end, so requests that ended in time are in.
    let grace_ms = (interval_ms / 4).min(250);
    let weak = Arc::downgrade(state);
    {
        let totals = prefetch_totals(state);
        state.stats.ring().sample_prefetch(totals, now_ms());
    }
    tracker.spawn(async move {
        loop {
            let now = now_ms();
            let end = now - now % interval_ms + interval_ms;
            let wait = Duration::from_millis(end + grace_ms - now);
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
            let Some(state) = weak.upgrade() else { return };
            let totals = prefetch_totals(&state);
            state.stats.ring().sample_prefetch(totals, end - 1);
            shared::publish(&state, now_ms(), false);
        }
        if let Some(state) = weak.upgrade() {
            let totals = prefetch_totals(&state);
            let now = now_ms();
            state.stats.ring().sample_prefetch(totals, now);
            shared::publish(&state, now, true);
        }
    });
}
