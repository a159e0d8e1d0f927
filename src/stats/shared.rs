//! Stats shared by the replicas through Redis: each publishes its intervals' rollups
//! ([`Interval`]: all tenants and each tenant) as one field, named by its replica id, of the
//! interval's hash `{prefix}:hash:{stats:<interval_secs>:<start_ms>}`, which lives as long as
//! the ring spans. A view reads the hashes of its window and merges every other replica's
//! field into its own rollups (its own field is skipped: its ring is fresher).
//!
//! An interval larger than readers take (`redis.max_value_bytes`) is published without its
//! question lists, or as its all-tenant rollup alone, so its counts still reach the others.
//!
//! Publishing is a queued write like every Redis write (dropped, and counted, when Redis is
//! slow or down), so a replica's intervals may be missing from the others' views, never
//! counted twice. A restarted replica has a new id: its earlier intervals are still read,
//! under the old id, until they expire.

use std::collections::BTreeSet;
use std::time::Duration;

use super::rollup::Rollup;
use super::Interval;
use crate::state::AppState;

/// Most replicas whose rollups are read per interval.
const MAX_REPLICAS: usize = 256;

/// The hash holding every replica's rollups of the interval starting at `start_ms`.
fn name(interval_secs: u64, start_ms: u64) -> String {
    format!("stats:{interval_secs}:{start_ms}")
}

/// Publishes the intervals that changed since they were last published: those that ended by
/// `now_ms`, and with `all` the open one too. Nothing without Redis.
pub fn publish(state: &AppState, now_ms: u64, all: bool) {
    let Some(redis) = state.store.redis() else {
        return;
    };
    let cfg = &state.config.stats;
    let ttl = Duration::from_secs(cfg.span_secs());
    let changed = state.stats.ring().unpublished(now_ms, all);
    for (start, interval) in changed {
        let Some(bytes) = fitted(interval, redis.max_value_bytes()) else {
            tracing::warn!(interval = start, "stats: an interval too large to publish");
            continue;
        };
        let name = name(cfg.interval_secs, start);
        if !redis.put_field(&name, redis.replica_id(), bytes, ttl) {
            tracing::debug!(interval = start, "stats: publication dropped");
        }
    }
}

/// `interval` as published: whole when it fits in `limit` bytes (what readers take), else
/// without its question lists, else its all-tenant rollup alone (the counts of every request
/// stay; what is cut is the detail). `None` when not even that fits.
fn fitted(mut interval: Interval, limit: usize) -> Option<Vec<u8>> {
    let fits = |i: &Interval| serde_json::to_vec(i).ok().filter(|b| b.len() <= limit);
    if let Some(bytes) = fits(&interval) {
        return Some(bytes);
    }
    interval.drop_detail();
    if let Some(bytes) = fits(&interval) {
        return Some(bytes);
    }
    interval.tenants.clear();
    fits(&interval)
}

/// Merges the other replicas' rollups of `tenant` (`None`: all requests) into `series`
/// (interval starts with this replica's rollups); returns the other replicas that had any.
/// When Redis cannot be read, nothing is merged (the view is this replica's alone).
pub async fn merge_remote(
    state: &AppState,
    series: &mut [(u64, Rollup)],
    tenant: Option<&str>,
) -> BTreeSet<String> {
    let mut others = BTreeSet::new();
    let Some(redis) = state.store.redis() else {
        return others;
    };
    let cfg = &state.config.stats;
    let mut merged: Vec<Rollup> = vec![Rollup::default(); series.len()];
    let round = reprise_cache::redis::FIELDS_ROUND;
    for (i, chunk) in series.chunks(round).enumerate() {
        let names: Vec<String> = chunk
            .iter()
            .map(|(start, _)| name(cfg.interval_secs, *start))
            .collect();
        let got = match redis.get_fields(&names, MAX_REPLICAS).await {
            Ok(got) => got,
            Err(e) => {
                tracing::warn!(error = %e, "stats: other replicas' rollups not read");
                return BTreeSet::new();
            }
        };
        for (j, fields) in got.into_iter().enumerate() {
            for (replica, bytes) in fields {
                if replica == redis.replica_id() {
                    continue;
                }
                let Ok(mut interval) = serde_json::from_slice::<Interval>(&bytes) else {
                    tracing::debug!(replica, "stats: an undecodable rollup skipped");
                    continue;
                };
                interval.bound(cfg.tenants);
                if let Some(r) = interval.of(tenant) {
                    merged[i * round + j].merge(r);
                }
                others.insert(replica);
            }
        }
    }
    for ((_, mine), theirs) in series.iter_mut().zip(&merged) {
        mine.merge(theirs);
    }
    others
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reqlog::LogRecord;

    #[test]
    fn an_interval_too_large_is_published_without_its_detail() {
        let mut interval = Interval::default();
        let long = "q".repeat(1000);
        for i in 0..200 {
            let rec = LogRecord {
                time_ms: 0,
                outcome: "miss",
                tenant: format!("t{}", i % 20),
                question: Some(format!("{i}{long}")),
                ..LogRecord::default()
            };
            interval.all.add(&rec);
            interval
                .tenants
                .entry(rec.tenant.clone())
                .or_default()
                .add(&rec);
        }
        let whole = serde_json::to_vec(&interval).unwrap();
        assert_eq!(fitted(interval.clone(), whole.len()), Some(whole.clone()));
        // Smaller than the whole: the counts of every tenant, without the questions.
        let slim: Interval =
            serde_json::from_slice(&fitted(interval.clone(), whole.len() / 4).unwrap()).unwrap();
        assert_eq!(slim.tenants.len(), 20);
        assert_eq!(slim.all.requests, 200);
        assert!(!slim.all.has_detail());
        // Smaller still: every request's counts, in the all-tenant rollup.
        let bare_len = {
            let mut bare = interval.clone();
            bare.drop_detail();
            bare.tenants.clear();
            serde_json::to_vec(&bare).unwrap().len()
        };
        let bare: Interval =
            serde_json::from_slice(&fitted(interval.clone(), bare_len).unwrap()).unwrap();
        assert!(bare.tenants.is_empty());
        assert_eq!(bare.all.requests, 200);
        assert_eq!(fitted(interval, 10), None);
    }
}
