//! The metrics of finished client requests, labelled by tenant and model: counts, latency
//! and first-token histograms by outcome, and what hits saved (tokens, backend seconds,
//! cost).
//!
//! Label values are bounded: `tenant` is a tenant's name (configured tenants only reach the
//! request path) or `anonymous`; `model` is one of the known models ([`RequestMetrics::new`])
//! or `other`. Handles are made once per label pair and kept, so a request costs a read lock
//! and two map probes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram};
use parking_lot::RwLock;

use super::Outcome;

/// The `tenant` label of the anonymous tenant.
pub const ANONYMOUS: &str = "anonymous";
/// The `model` label of models nobody configured.
pub const OTHER_MODEL: &str = "other";

/// What one finished request contributes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Finished<'a> {
    /// The tenant's name (empty: anonymous).
    pub tenant: &'a str,
    /// The model asked for.
    pub model: &'a str,
    /// Total seconds.
    pub total: f64,
    /// Seconds to the first token, when one was sent.
    pub first_token: Option<f64>,
    /// A hit's savings: prompt and completion tokens, backend seconds, cost.
    pub saved: Option<Saved>,
}

/// What a hit saved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Saved {
    /// Prompt tokens of the generation the hit replaced.
    pub prompt_tokens: u32,
    /// Completion tokens of that generation.
    pub completion_tokens: u32,
    /// Backend seconds of that generation.
    pub backend_seconds: f64,
    /// Its cost at the configured price (0 without one).
    pub cost: f64,
}

struct Labelled {
    requests: [Counter; 6],
    duration: [Histogram; 6],
    ttft: [Histogram; 6],
    prompt_tokens: Counter,
    completion_tokens: Counter,
    backend_seconds: Gauge,
    cost: Gauge,
}

impl Labelled {
    fn new(tenant: &str, model: &str) -> Self {
        let (t, m) = (tenant.to_string(), model.to_string());
        let labels = |o: Outcome| {
            [
                ("outcome", o.as_str().to_string()),
                ("tenant", t.clone()),
                ("model", m.clone()),
            ]
        };
        let tm = [("tenant", t.clone()), ("model", m.clone())];
        let tokens = |kind: &'static str| metrics::counter!("reprise_saved_tokens_total", "tenant" => t.clone(), "model" => m.clone(), "kind" => kind);
        Labelled {
            requests: Outcome::ALL.map(|o| metrics::counter!("reprise_requests_total", &labels(o))),
            duration: Outcome::ALL
                .map(|o| metrics::histogram!("reprise_request_duration_seconds", &labels(o))),
            ttft: Outcome::ALL
                .map(|o| metrics::histogram!("reprise_time_to_first_token_seconds", &labels(o))),
            prompt_tokens: tokens("prompt"),
            completion_tokens: tokens("completion"),
            backend_seconds: metrics::gauge!("reprise_saved_backend_seconds", &tm),
            cost: metrics::gauge!("reprise_saved_cost", &tm),
        }
    }
}

/// The request metrics' handles by label pair.
pub struct RequestMetrics {
    known_models: HashSet<String>,
    by_tenant: RwLock<HashMap<String, HashMap<String, Arc<Labelled>>>>,
}

impl RequestMetrics {
    /// Metrics whose `model` label keeps the names in `models` (others are `other`).
    pub fn new(models: impl IntoIterator<Item = String>) -> Self {
        RequestMetrics {
            known_models: models.into_iter().collect(),
            by_tenant: RwLock::new(HashMap::new()),
        }
    }

    /// The `tenant` label of a tenant's name.
    pub fn tenant_label(tenant: &str) -> &str {
        if tenant.is_empty() {
            ANONYMOUS
        } else {
            tenant
        }
    }

    /// The `model` label of a model name.
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.known_models.contains(model) {
            model
        } else {
            OTHER_MODEL
        }
    }

    fn handles(&self, tenant: &str, model: &str) -> Arc<Labelled> {
        let (tenant, model) = (Self::tenant_label(tenant), self.model_label(model));
        if let Some(h) = self.by_tenant.read().get(tenant).and_then(|m| m.get(model)) {
            return h.clone();
        }
        self.by_tenant
            .write()
            .entry(tenant.to_string())
            .or_default()
            .entry(model.to_string())
            .or_insert_with(|| Arc::new(Labelled::new(tenant, model)))
            .clone()
    }

    /// Records a finished request.
    pub fn record(&self, outcome: Outcome, r: &Finished<'_>) {
        let h = self.handles(r.tenant, r.model);
        let i = outcome as usize;
        h.requests[i].increment(1);
        h.duration[i].record(r.total);
        if let Some(t) = r.first_token {
            h.ttft[i].record(t);
        }
        if let Some(s) = r.saved {
            h.prompt_tokens.increment(u64::from(s.prompt_tokens));
            h.completion_tokens
                .increment(u64::from(s.completion_tokens));
            h.backend_seconds.increment(s.backend_seconds);
            h.cost.increment(s.cost);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stay_within_the_known_values() {
        let m = RequestMetrics::new(["served".to_string()]);
        assert_eq!(m.model_label("served"), "served");
        assert_eq!(m.model_label("made-up-by-a-client"), OTHER_MODEL);
        assert_eq!(RequestMetrics::tenant_label(""), ANONYMOUS);
        assert_eq!(RequestMetrics::tenant_label("acme"), "acme");
        // Every unknown model shares one set of handles.
        let a = m.handles("acme", "x1");
        let b = m.handles("acme", "x2");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(m.by_tenant.read()["acme"].len(), 1);
    }
}
