//! `[degrade]`: what an interactive request does when the backend its route picked would
//! answer it too late for the route's SLO.

use serde::Deserialize;

use super::{invalid, Config, ConfigError};

/// One way to answer a request whose backend is predicted to miss the SLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DegradeStep {
    /// Serve the best cached paraphrase at a looser similarity threshold (never below
    /// `loose_floor`; the false-hit gate, freshness and refusals still apply). A tenant
    /// under an error bound (`delta`) is never served below its learned threshold.
    LooseThreshold,
    /// Serve an expired entry of the exact key still kept for the stale windows.
    Stale,
    /// Send the request to its route's fallback backend (unless that one is at risk too).
    Fallback,
    /// Refuse with 429 and `Retry-After` (the predicted wait).
    Refuse,
}

/// `[degrade]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DegradeConfig {
    /// Degrade interactive requests whose predicted wait breaks their route's SLO (off: they
    /// wait in the backend's line as before).
    pub enabled: bool,
    /// What to try, in order; the first that can answer does. Without `refuse` a request
    /// nothing else can answer waits for the backend.
    pub order: Vec<DegradeStep>,
    /// `loose_threshold`: the lowest similarity a degraded semantic hit may have.
    pub loose_floor: f32,
    /// Seconds background work (prefetch, refresh-ahead, checks of hits) stays shed after a
    /// request found its backend at risk: it is shed first.
    pub shed_background_secs: f64,
}

impl Default for DegradeConfig {
    fn default() -> Self {
        DegradeConfig {
            enabled: false,
            order: vec![
                DegradeStep::LooseThreshold,
                DegradeStep::Stale,
                DegradeStep::Fallback,
                DegradeStep::Refuse,
            ],
            loose_floor: 0.8,
            shed_background_secs: 2.0,
        }
    }
}

impl DegradeConfig {
    pub(super) fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        if !(self.loose_floor > 0.0 && self.loose_floor <= 1.0) {
            return Err(invalid("degrade.loose_floor", "must be in (0, 1]"));
        }
        if self.loose_floor < config.semantic.min_threshold {
            return Err(invalid(
                "degrade.loose_floor",
                "must be at least semantic.min_threshold",
            ));
        }
        for (i, s) in self.order.iter().enumerate() {
            if self.order[..i].contains(s) {
                return Err(invalid("degrade.order", format!("{s:?} is listed twice")));
            }
        }
        if !(0.0..=3600.0).contains(&self.shed_background_secs) {
            return Err(invalid(
                "degrade.shed_background_secs",
                "must be 0 to 3600 seconds",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_parses_and_is_checked() {
        let c = Config::from_toml("[degrade]\nenabled = true\norder = [\"stale\", \"refuse\"]\n")
            .unwrap();
        assert_eq!(c.degrade.order, [DegradeStep::Stale, DegradeStep::Refuse]);
        for (toml, key) in [
            (
                "[degrade]\norder = [\"stale\", \"stale\"]\n",
                "degrade.order",
            ),
            ("[degrade]\nloose_floor = 0.5\n", "degrade.loose_floor"),
            ("[degrade]\nloose_floor = 1.5\n", "degrade.loose_floor"),
        ] {
            let err = Config::from_toml(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml}: {err}");
        }
        assert!(Config::from_toml("[degrade]\norder = [\"pray\"]\n").is_err());
    }
}
