//! The JSON of `GET /admin/stats?minutes=N&tenant=NAME`: a series of intervals (oldest
//! first, every interval of the window, empty ones as zeros), their totals, the window's most
//! missed questions and most served pairs, and the gate's rejections. A dashboard is written
//! against these names: change none of them.

use serde_json::{json, Value};

use super::hist::Histogram;
use super::rollup::{HitMiss, Rollup};
use crate::error::ApiError;
use crate::state::AppState;

/// Minutes a view covers when `minutes` is not given (or the ring's span, when shorter:
/// so does a longer `minutes`).
const DEFAULT_MINUTES: u64 = 60;

/// The stats of the last `minutes` (a number of minutes, at most the ring's span), of one
/// tenant (a tenant label) or of all; merged across replicas when Redis is configured.
pub async fn view(
    state: &AppState,
    minutes: Option<&str>,
    tenant: Option<&str>,
) -> Result<Value, ApiError> {
    let cfg = &state.config.stats;
    if !state.stats.enabled() {
        return Err(ApiError::NotFound {
            message: "stats are off ([stats] enabled = false)".into(),
            param: None,
        });
    }
    let span_minutes = (cfg.span_secs() / 60).max(1);
    // A window longer than the ring holds is the whole ring (the answer says which).
    let minutes = match minutes {
        None => DEFAULT_MINUTES,
        Some(m) => match m.parse::<u64>() {
            Ok(m) if m >= 1 => m,
            _ => {
                return Err(ApiError::invalid(
                    "`minutes` must be a whole number of minutes, at least 1",
                    Some("minutes"),
                ))
            }
        },
    }
    .min(span_minutes);
    let now = reprise_cache::now_ms();
    let interval_ms = cfg.interval_secs * 1000;
    let current = now - now % interval_ms;
    let first = window_start(now, interval_ms, minutes, cfg.intervals as u64);
    let totals = super::prefetch_totals(state);
    let mut series = {
        let ring = state.stats.ring();
        let mut series = ring.window(first, current, tenant);
        if tenant.is_none() {
            // What the prefetcher did since the last sample belongs to the open interval.
            let pending = ring.prefetch_pending(totals);
            if let Some((_, open)) = series.last_mut() {
                open.prefetch.completed += pending.completed;
                open.prefetch.hits += pending.hits;
                open.prefetch.wasted += pending.wasted;
            }
        }
        series
    };
    let others = super::shared::merge_remote(state, &mut series, tenant).await;
    let mut total = Rollup::default();
    for (_, r) in &series {
        total.merge(r);
    }
    Ok(json!({
        "now_ms": now,
        "minutes": minutes,
        "span_minutes": span_minutes,
        "interval_secs": cfg.interval_secs,
        "replicas": 1 + others.len(),
        "tenant": tenant,
        "slo": {"total_secs": state.config.slo.total_secs, "ttft_secs": state.config.slo.ttft_secs},
        "currency": state.config.metrics.currency,
        "series": series.iter().map(|(start, r)| summary(r, Some(*start))).collect::<Vec<_>>(),
        "totals": summary(&total, None),
        "top_missed": top_missed(&total),
        "top_pairs": top_pairs(&total),
        "gate_rejections": total.gate_rejections,
    }))
}

/// p50, p95 and p99 in seconds (`null` without samples) and the count.
fn percentiles(h: &Histogram) -> Value {
    let q = |q: f64| h.quantile_ms(q).map(|ms| ms / 1000.0);
    json!({"p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "count": h.count()})
}

fn hit_miss(h: &HitMiss) -> Value {
    json!({"hit": percentiles(&h.hit), "miss": percentiles(&h.miss)})
}

/// One series element (with its `start_ms`) or the totals (without).
pub fn summary(r: &Rollup, start_ms: Option<u64>) -> Value {
    let mut v = json!({
        "requests": r.requests,
        "by_outcome": r.by_outcome,
        "by_tier": r.by_tier,
        "by_tenant": r.by_tenant,
        "latency": hit_miss(&r.latency),
        "ttft": hit_miss(&r.ttft),
        "saved": r.saved,
        "prefetch": r.prefetch,
    });
    if let Some(start) = start_ms {
        v["start_ms"] = start.into();
    }
    v
}

/// The most missed questions, most first.
pub fn top_missed(r: &Rollup) -> Vec<Value> {
    r.top_missed
        .sorted()
        .into_iter()
        .map(|c| json!({"question": c.key, "count": c.count, "best_similarity": c.detail.0}))
        .collect()
}

/// The start of the oldest interval of the window of the last `minutes` at `now_ms`: the
/// interval holding `now_ms - minutes`, so the window covers every one of those minutes (and
/// up to one interval more, the intervals being whole), and at most `intervals` intervals.
fn window_start(now_ms: u64, interval_ms: u64, minutes: u64, intervals: u64) -> u64 {
    let current = now_ms - now_ms % interval_ms;
    let since = now_ms.saturating_sub(minutes.saturating_mul(60_000));
    let oldest = current.saturating_sub(intervals.saturating_sub(1).saturating_mul(interval_ms));
    (since - since % interval_ms).max(oldest)
}

/// The most served (question, matched) pairs, most first.
pub fn top_pairs(r: &Rollup) -> Vec<Value> {
    r.top_pairs
        .sorted()
        .into_iter()
        .map(|c| {
            json!({"question": c.key.0, "matched": c.key.1, "similarity": c.detail.similarity,
                   "count": c.count, "entry_id": c.detail.entry_id})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reqlog::LogRecord;

    /// A window of N minutes covers every one of the last N minutes, whatever the time in
    /// the current interval, and never more intervals than are kept.
    #[test]
    fn a_window_covers_all_its_minutes() {
        let minute = 60_000;
        // Two seconds into an interval of a minute: the last minute began in the one before.
        let now = 10 * minute + 2_000;
        assert_eq!(window_start(now, minute, 1, 60), 9 * minute);
        assert_eq!(window_start(now, minute, 2, 60), 8 * minute);
        // At an interval's first millisecond, the minute before is exactly the one before.
        assert_eq!(window_start(10 * minute, minute, 1, 60), 9 * minute);
        // Hour-long intervals: the last hour reaches into the previous one.
        let hour = 60 * minute;
        assert_eq!(window_start(5 * hour + minute, hour, 60, 24), 4 * hour);
        // Never more intervals than the ring keeps.
        assert_eq!(window_start(now, minute, 60, 3), 8 * minute);
        assert_eq!(window_start(now, minute, 60, 1), 10 * minute);
    }

    #[test]
    fn a_summary_has_the_dashboards_names() {
        let mut r = Rollup::default();
        r.add(&LogRecord {
            outcome: "exact",
            tier: Some("memory"),
            total_ms: 2.0,
            ttft_ms: Some(2.0),
            tenant: "acme".into(),
            saved_prompt_tokens: 3,
            ..Default::default()
        });
        let v = summary(&r, Some(60_000));
        for key in [
            "/start_ms",
            "/requests",
            "/by_outcome/exact",
            "/by_outcome/semantic",
            "/by_outcome/prefetch",
            "/by_outcome/miss",
            "/by_outcome/bypass",
            "/by_outcome/error",
            "/by_tier/memory",
            "/by_tier/redis",
            "/by_tier/semantic",
            "/by_tier/prefetch",
            "/by_tenant/acme/requests",
            "/by_tenant/acme/hits",
            "/latency/hit/p50",
            "/latency/hit/p95",
            "/latency/hit/p99",
            "/latency/hit/count",
            "/latency/miss/p50",
            "/ttft/hit/count",
            "/ttft/miss/p99",
            "/saved/prompt_tokens",
            "/saved/completion_tokens",
            "/saved/backend_seconds",
            "/saved/cost",
            "/prefetch/completed",
            "/prefetch/hits",
            "/prefetch/wasted",
        ] {
            assert!(v.pointer(key).is_some(), "{key} in {v}");
        }
        assert_eq!(v["latency"]["miss"]["p50"], Value::Null);
        let p50 = v["latency"]["hit"]["p50"].as_f64().unwrap();
        assert!((p50 - 0.002).abs() < 0.002 * 0.27, "seconds: {p50}");
        assert!(summary(&r, None).get("start_ms").is_none());
    }
}
