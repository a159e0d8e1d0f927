//! `[stats]`: the in-memory ring of per-interval rollups behind `GET /admin/stats`
//! ([`crate::stats`]).

use serde::Deserialize;

use super::{invalid, Config, ConfigError};

/// `[stats]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StatsConfig {
    /// Keep rollups of the requests served (off: `GET /admin/stats` answers 404).
    pub enabled: bool,
    /// Length of one interval, seconds (one point of the series).
    pub interval_secs: u64,
    /// Intervals kept (the span `GET /admin/stats?minutes=` can reach; with Redis, also how
    /// long published intervals live there).
    pub intervals: usize,
    /// Bytes the kept intervals may take in memory (approximately). Past it, the question
    /// lists (top missed, top pairs) of the oldest intervals are dropped first, then the
    /// oldest intervals.
    pub memory_bytes: u64,
    /// Tenants with rollups of their own per interval (what a tenant's view reads); requests
    /// of tenants past it count in the all-tenant rollup only.
    pub tenants: usize,
}

impl Default for StatsConfig {
    fn default() -> Self {
        StatsConfig {
            enabled: true,
            interval_secs: 60,
            intervals: 1440,
            memory_bytes: 64 * 1024 * 1024,
            tenants: 64,
        }
    }
}

impl StatsConfig {
    /// Seconds the kept intervals span.
    pub fn span_secs(&self) -> u64 {
        self.interval_secs.saturating_mul(self.intervals as u64)
    }
}

pub(super) fn validate(config: &Config) -> Result<(), ConfigError> {
    let s = &config.stats;
    if !(1..=86_400).contains(&s.interval_secs) {
        return Err(invalid("stats.interval_secs", "must be 1 to 86400 seconds"));
    }
    if !(1..=100_000).contains(&s.intervals) {
        return Err(invalid("stats.intervals", "must be 1 to 100000"));
    }
    if s.span_secs() < 60 || s.span_secs() > 400 * 86_400 {
        return Err(invalid(
            "stats.intervals",
            "interval_secs × intervals must span one minute to 400 days",
        ));
    }
    if s.memory_bytes < 1024 * 1024 {
        return Err(invalid("stats.memory_bytes", "must be at least 1 MiB"));
    }
    if s.tenants > 4096 {
        return Err(invalid("stats.tenants", "must be at most 4096"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::Config;

    #[test]
    fn the_example_file_has_the_defaults() {
        let c = Config::from_toml(include_str!("../../reprise.example.toml")).unwrap();
        let d = super::StatsConfig::default();
        let s = &c.stats;
        assert_eq!(
            (
                s.enabled,
                s.interval_secs,
                s.intervals,
                s.memory_bytes,
                s.tenants
            ),
            (
                d.enabled,
                d.interval_secs,
                d.intervals,
                d.memory_bytes,
                d.tenants
            )
        );
    }

    #[test]
    fn defaults_parse_and_bad_values_are_refused() {
        let c = Config::from_toml("[stats]\ninterval_secs = 300\nintervals = 288").unwrap();
        assert_eq!(c.stats.span_secs(), 86_400);
        assert!(c.stats.enabled);
        for bad in [
            "[stats]\ninterval_secs = 0",
            "[stats]\nintervals = 0",
            "[stats]\ninterval_secs = 10\nintervals = 5",
            "[stats]\nmemory_bytes = 10",
            "[stats]\ntenants = 100000",
            "[stats]\nunknown = 1",
        ] {
            let e = Config::from_toml(bad).unwrap_err().to_string();
            assert!(e.contains("stats"), "{bad}: {e}");
        }
    }
}
