//! The tier's metrics: their descriptions, the operations that label them, and the handles
//! each tier holds.

use metrics::{describe_counter, describe_gauge, describe_histogram, Counter, Gauge, Histogram};

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
pub(super) enum Op {
    Get,
    GetByKey,
    Put,
    Alias,
    Delete,
    DeleteNamespace,
    DeleteTag,
    Scan,
    Events,
    Policies,
    Sweep,
}

impl Op {
    const ALL: [Op; 11] = [
        Op::Get,
        Op::GetByKey,
        Op::Put,
        Op::Alias,
        Op::Delete,
        Op::DeleteNamespace,
        Op::DeleteTag,
        Op::Scan,
        Op::Events,
        Op::Policies,
        Op::Sweep,
    ];

    pub(super) fn as_str(self) -> &'static str {
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
            Op::Policies => "policies",
            Op::Sweep => "sweep",
        }
    }
}

/// Metric handles, created once per tier.
pub(super) struct RedisMetrics {
    pub(super) up: Gauge,
    pub(super) breaker_open: Gauge,
    pub(super) dropped: Counter,
    pub(super) skipped: Counter,
    errors: [Counter; Op::ALL.len()],
    duration: [Histogram; Op::ALL.len()],
}

impl RedisMetrics {
    pub(super) fn new() -> Self {
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

    pub(super) fn errors(&self, op: Op) -> &Counter {
        &self.errors[op as usize]
    }

    pub(super) fn duration(&self, op: Op) -> &Histogram {
        &self.duration[op as usize]
    }
}
