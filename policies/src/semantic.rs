//! The semantic policy of one request: on or off, threshold, candidates, gate — the
//! configured defaults, overridden per namespace and/or model by the first matching rule, and
//! raised (never lowered) by the request's own threshold.

use serde::{Deserialize, Serialize};

/// The effective semantic policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SemanticPolicy {
    /// Serve near-duplicates at all.
    pub enabled: bool,
    /// Lowest cosine similarity served.
    pub threshold: f32,
    /// Candidates examined.
    pub top_k: usize,
    /// Run the false-hit gate.
    pub gate: bool,
    /// Match a standalone last question (see [`crate::standalone`]) across unrelated
    /// earlier conversations; off: only within its own context.
    pub standalone: bool,
    /// Treat conversations whose system prompts and earlier messages differ only by a
    /// paraphrase as one context; off: contexts match exactly.
    pub context_equivalence: bool,
    /// Lowest cosine similarity served for a follow-up: a last message that refers back into
    /// its conversation (see [`crate::standalone`]), matched only within its (equivalent)
    /// context, where the same content is already established. `None`: `threshold`. See
    /// [`SemanticPolicy::followup`].
    pub followup_threshold: Option<f32>,
}

impl SemanticPolicy {
    /// This policy with a client's threshold (`x-reprise-threshold`), which only ever
    /// raises its thresholds.
    pub fn raised(mut self, requested: Option<f32>) -> SemanticPolicy {
        if let Some(t) = requested {
            self.threshold = self.threshold.max(t);
            self.followup_threshold = self.followup_threshold.map(|f| f.max(t));
        }
        self
    }

    /// The threshold a follow-up is served at: `followup_threshold`, never above
    /// `threshold` (which a client's own threshold has already raised).
    pub fn followup(&self) -> f32 {
        self.followup_threshold
            .map_or(self.threshold, |f| f.min(self.threshold))
    }
}

/// One override rule (`[[semantic.rules]]`): applies when every given selector matches.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Rule {
    /// Namespace the rule applies to (any when absent).
    pub namespace: Option<String>,
    /// Model the rule applies to (any when absent).
    pub model: Option<String>,
    /// Overrides `enabled`.
    pub enabled: Option<bool>,
    /// Overrides `threshold`.
    pub threshold: Option<f32>,
    /// Overrides `top_k`.
    pub top_k: Option<usize>,
    /// Overrides `gate`.
    pub gate: Option<bool>,
    /// Overrides `standalone`.
    pub standalone: Option<bool>,
    /// Overrides `context_equivalence`.
    pub context_equivalence: Option<bool>,
    /// Overrides `followup_threshold`.
    pub followup_threshold: Option<f32>,
}

/// The most candidates a policy may examine per lookup: each one is vetted by the gate, and
/// a partition small enough to scan keeps a list of that many.
pub const MAX_TOP_K: usize = 64;

/// Why a setting of a policy or rule is out of range: `(key, reason)`, the key relative to
/// the policy (`threshold`, `top_k`, ...).
pub type Invalid = (&'static str, &'static str);

/// Checks a threshold-like setting: within (0, 1] (NaN is not).
pub fn check_threshold(key: &'static str, t: f32) -> Result<(), Invalid> {
    if t > 0.0 && t <= 1.0 {
        Ok(())
    } else {
        Err((key, "must be in (0, 1]"))
    }
}

/// Checks a `top_k` setting: within 1..=[`MAX_TOP_K`].
pub fn check_top_k(k: usize) -> Result<(), Invalid> {
    if (1..=MAX_TOP_K).contains(&k) {
        Ok(())
    } else {
        Err(("top_k", "must be in 1..=64"))
    }
}

impl Rule {
    /// Checks what the rule overrides, as [`check_threshold`] and [`check_top_k`] do.
    pub fn check(&self) -> Result<(), Invalid> {
        if let Some(t) = self.threshold {
            check_threshold("threshold", t)?;
        }
        if let Some(t) = self.followup_threshold {
            check_threshold("followup_threshold", t)?;
        }
        if let Some(k) = self.top_k {
            check_top_k(k)?;
        }
        Ok(())
    }

    fn matches(&self, namespace: &str, model: &str) -> bool {
        self.namespace.as_deref().is_none_or(|n| n == namespace)
            && self.model.as_deref().is_none_or(|m| m == model)
    }

    /// What the rule applies to, `namespace/model` (`*`: any): the scope whose verdicts
    /// learn its threshold ([`scope`]).
    pub fn scope(&self) -> String {
        format!(
            "{}/{}",
            self.namespace.as_deref().unwrap_or("*"),
            self.model.as_deref().unwrap_or("*")
        )
    }
}

/// The first of `rules` that applies to `namespace` and `model`.
pub fn matching<'a>(
    rules: impl IntoIterator<Item = &'a Rule>,
    namespace: &str,
    model: &str,
) -> Option<&'a Rule> {
    rules.into_iter().find(|r| r.matches(namespace, model))
}

/// The scope of a request's policy: the matching rule's (see [`Rule::scope`]), or `*/*`
/// for the defaults. Verdicts are kept per scope, so evidence gathered under one threshold
/// never moves another rule's.
pub fn scope(rule: Option<&Rule>) -> String {
    rule.map_or_else(|| "*/*".to_string(), Rule::scope)
}

/// The policy for a request: defaults, then the first matching rule (in the order given:
/// a tenant's own rules before the global ones), then the request's threshold if it is
/// higher.
pub fn resolve<'a>(
    defaults: SemanticPolicy,
    rules: impl IntoIterator<Item = &'a Rule>,
    namespace: &str,
    model: &str,
    requested_threshold: Option<f32>,
) -> SemanticPolicy {
    let mut p = defaults;
    if let Some(r) = matching(rules, namespace, model) {
        p.enabled = r.enabled.unwrap_or(p.enabled);
        p.threshold = r.threshold.unwrap_or(p.threshold);
        p.top_k = r.top_k.unwrap_or(p.top_k);
        p.gate = r.gate.unwrap_or(p.gate);
        p.standalone = r.standalone.unwrap_or(p.standalone);
        p.context_equivalence = r.context_equivalence.unwrap_or(p.context_equivalence);
        p.followup_threshold = r.followup_threshold.or(p.followup_threshold);
    }
    p.raised(requested_threshold)
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: SemanticPolicy = SemanticPolicy {
        enabled: true,
        threshold: 0.86,
        top_k: 4,
        gate: true,
        standalone: true,
        context_equivalence: true,
        followup_threshold: None,
    };

    #[test]
    fn first_matching_rule_wins_and_header_only_raises() {
        let rules = vec![
            Rule {
                namespace: Some("legal".into()),
                threshold: Some(0.95),
                ..Default::default()
            },
            Rule {
                model: Some("big".into()),
                enabled: Some(false),
                ..Default::default()
            },
        ];
        assert_eq!(resolve(D, &rules, "default", "small", None), D);
        assert_eq!(resolve(D, &rules, "legal", "big", None).threshold, 0.95);
        assert!(resolve(D, &rules, "legal", "big", None).enabled);
        assert!(!resolve(D, &rules, "other", "big", None).enabled);
        assert_eq!(resolve(D, &rules, "legal", "x", Some(0.5)).threshold, 0.95);
        assert_eq!(resolve(D, &rules, "x", "x", Some(0.97)).threshold, 0.97);
        // Each rule is its own scope; the defaults are one more.
        assert_eq!(scope(matching(&rules, "legal", "big")), "legal/*");
        assert_eq!(scope(matching(&rules, "other", "big")), "*/big");
        assert_eq!(scope(matching(&rules, "other", "small")), "*/*");
    }

    #[test]
    fn rules_are_checked_for_range() {
        let ok = Rule {
            threshold: Some(0.9),
            followup_threshold: Some(0.8),
            top_k: Some(MAX_TOP_K),
            ..Default::default()
        };
        assert_eq!(ok.check(), Ok(()));
        for (bad, key) in [
            (
                Rule {
                    top_k: Some(0),
                    ..ok.clone()
                },
                "top_k",
            ),
            (
                Rule {
                    top_k: Some(MAX_TOP_K + 1),
                    ..ok.clone()
                },
                "top_k",
            ),
            (
                Rule {
                    threshold: Some(f32::NAN),
                    ..ok.clone()
                },
                "threshold",
            ),
            (
                Rule {
                    threshold: Some(1.5),
                    ..ok.clone()
                },
                "threshold",
            ),
            (
                Rule {
                    followup_threshold: Some(0.0),
                    ..ok.clone()
                },
                "followup_threshold",
            ),
            (
                Rule {
                    followup_threshold: Some(-1.0),
                    ..ok.clone()
                },
                "followup_threshold",
            ),
        ] {
            assert_eq!(bad.check().map_err(|e| e.0), Err(key), "{bad:?}");
        }
    }
}
