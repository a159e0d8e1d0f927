//! Learned thresholds under an error bound (`[semantic] delta`, a tenant's `policy.delta`):
//! the verdicts on answers matched by meaning, kept per tenant, and the threshold they allow
//! ([`reprise_policies::bound`] decides; this module keeps the evidence and reports it).
//!
//! Verdicts come from `POST /v1/feedback` on semantic and prefetch hits (at the similarity the
//! hit was served at) and from checked near misses: a miss whose best candidate was under the
//! threshold, once the backend answered it, is judged against the candidate's answer by
//! embedding similarity (`[semantic] answer_threshold`), the share `verify_near_misses` of
//! them, off the request path and without another backend call. Near misses are what let a
//! threshold fall: verdicts on served hits only ever speak of similarities already served.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use reprise_cache::EntryId;
use reprise_policies::bound::{Evidence, Learned};

use crate::share::ExactShare;
use crate::state::AppState;

/// Confidence of the bound: the wrong share is at most `delta` with probability 95 %.
const ALPHA: f64 = 0.05;
/// Verdicts kept per tenant before old ones weigh half.
const DECAY_AT: f64 = 100_000.0;

/// Where a verdict came from (metric label).
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// `POST /v1/feedback`.
    Feedback,
    /// A near miss checked against the backend's answer.
    NearMiss,
    /// A hit checked in the background ([`crate::verify`]).
    Verified,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Feedback => "feedback",
            Source::NearMiss => "near_miss",
            Source::Verified => "verified",
        }
    }
}

/// The evidence of every tenant ("" for the anonymous one).
#[derive(Default)]
pub struct Bounds {
    evidence: Mutex<HashMap<String, Evidence>>,
    /// Near misses seen, for sampling.
    near_misses: ExactShare,
}

impl Bounds {
    /// Whether the next near miss is checked, for a `share` of them (every n-th, so the
    /// share is exact at any count).
    pub fn sample(&self, share: f64) -> bool {
        self.near_misses.take(share)
    }

    /// Records a verdict on a candidate of `tenant` found at `similarity`.
    pub fn record(
        &self,
        state: &AppState,
        tenant: &str,
        similarity: f32,
        wrong: bool,
        source: Source,
    ) {
        {
            let mut all = self.evidence.lock();
            let e = all.entry(tenant.to_string()).or_default();
            e.record(similarity, wrong);
            if e.total() > DECAY_AT {
                e.decay();
            }
        }
        let verdict = if wrong { "wrong" } else { "right" };
        state.metrics.verdict(tenant, source.as_str(), verdict);
    }

    /// The threshold `tenant` serves at under `delta`, from `configured` (`floor`: the lowest
    /// it may learn).
    pub fn threshold(&self, tenant: &str, delta: f64, configured: f32, floor: f32) -> Learned {
        let all = self.evidence.lock();
        match all.get(tenant) {
            Some(e) => e.threshold(delta, ALPHA, configured, floor.min(configured)),
            None => Evidence::default().threshold(delta, ALPHA, configured, floor),
        }
    }
}

/// The bound of the tenant of `namespace` (0: none).
pub fn delta_of(state: &AppState, tenant: &crate::auth::Tenant) -> f64 {
    tenant.policy().delta.unwrap_or(state.config.semantic.delta)
}

/// Checks a near miss once the backend answered its question: the candidate `candidate`
/// (found at `similarity`) is judged against `answer`. Runs on its own task.
pub fn check_near_miss(
    state: &Arc<AppState>,
    tenant: String,
    candidate: EntryId,
    similarity: f32,
    answer: String,
) {
    let (Some(embedder), state) = (state.embedder.clone(), state.clone()) else {
        return;
    };
    tokio::spawn(async move {
        let Some(entry) = state.store.get(candidate).await else {
            return;
        };
        let texts = [answer, entry.text.clone()];
        let Ok(v) = embedder.embed_many_in(&tenant, &texts).await else {
            return;
        };
        let same = reprise_embedder::cosine(&v[0], &v[1]) >= state.config.semantic.answer_threshold;
        state
            .bounds
            .record(&state, &tenant, similarity, !same, Source::NearMiss);
    });
}
