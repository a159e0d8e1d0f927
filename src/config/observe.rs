//! What analysts read: `[slo]` (latency targets) and `[metrics]` (label values and prices);
//! the bound on `log.question_chars`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{invalid, Config, ConfigError};

/// `[slo]`: the latency targets, as 95th percentiles. The dashboard draws them, the alert
/// rules compare against them (`reprise_slo_seconds`), and a request slower than `total_secs`
/// is always traced.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SloConfig {
    /// Whole answer, seconds.
    pub total_secs: f64,
    /// First token (or the whole answer of a hit), seconds.
    pub ttft_secs: f64,
}

impl Default for SloConfig {
    fn default() -> Self {
        SloConfig {
            total_secs: 3.0,
            ttft_secs: 1.0,
        }
    }
}

/// `[metrics]`: the `model` label's values and what answers cost.
///
/// Labels stay bounded: `tenant` is a configured tenant (or `anonymous`); `model` is a
/// served model, a model a tenant may use, one listed here or one with a price, and
/// `other` for anything else.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Model names kept as `model` label values besides the served ones.
    pub models: Vec<String>,
    /// The currency prices are in (shown beside the cost saved).
    pub currency: Option<String>,
    /// Per-model prices (`[metrics.prices."gpt-4o-mini"]`): what a hit on that model saves.
    pub prices: BTreeMap<String, Price>,
}

/// What one model's tokens cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Price {
    /// Per million prompt tokens.
    pub prompt_per_million: f64,
    /// Per million completion tokens.
    pub completion_per_million: f64,
}

impl Price {
    /// The cost of a generation of these token counts.
    pub fn cost(&self, prompt_tokens: u32, completion_tokens: u32) -> f64 {
        (f64::from(prompt_tokens) * self.prompt_per_million
            + f64::from(completion_tokens) * self.completion_per_million)
            / 1e6
    }
}

/// Most question characters kept: the log and the stats stay small whatever is configured.
pub const MAX_QUESTION_CHARS: usize = 4096;

/// Longest latency target: below the top finite bucket of the latency histograms
/// (`crate::metrics::LATENCY_BUCKETS`), so a P95 over the target can still be seen (and
/// alerted on) in them.
pub const MAX_SLO_SECS: f64 = 60.0;

pub(super) fn validate(config: &Config) -> Result<(), ConfigError> {
    if config.log.question_chars > MAX_QUESTION_CHARS {
        return Err(invalid(
            "log.question_chars",
            format!("must be at most {MAX_QUESTION_CHARS}"),
        ));
    }
    for (key, secs) in [
        ("slo.total_secs", config.slo.total_secs),
        ("slo.ttft_secs", config.slo.ttft_secs),
    ] {
        if !(secs > 0.0 && secs <= MAX_SLO_SECS) {
            return Err(invalid(
                key,
                format!("must be more than 0 and at most {MAX_SLO_SECS} seconds"),
            ));
        }
    }
    for (model, p) in &config.metrics.prices {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(p.prompt_per_million) || !ok(p.completion_per_million) {
            return Err(invalid(
                "metrics.prices",
                format!("prices of `{model}` must be finite and not negative"),
            ));
        }
    }
    if config.metrics.models.len() + config.metrics.prices.len() > 256 {
        return Err(invalid(
            "metrics.models",
            "at most 256 model label values (models and prices together)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::Config;

    #[test]
    fn prices_and_targets_parse_and_bad_ones_are_refused() {
        let c = Config::from_toml(
            r#"
            [slo]
            total_secs = 2.5
            [metrics.prices."gpt-x"]
            prompt_per_million = 1.0
            completion_per_million = 4.0
            "#,
        )
        .unwrap();
        assert_eq!(c.slo.total_secs, 2.5);
        let p = c.metrics.prices["gpt-x"];
        assert!((p.cost(1_000_000, 500_000) - 3.0).abs() < 1e-9);
        for bad in [
            "[slo]\nttft_secs = 0",
            "[log]\nquestion_chars = 100000",
            "[metrics.prices.m]\nprompt_per_million = -1",
        ] {
            let e = Config::from_toml(bad).unwrap_err().to_string();
            assert!(
                e.contains("slo.") || e.contains("log.") || e.contains("metrics."),
                "{e}"
            );
        }
    }
}
