//! Step 5 of the request path: the semantic lookup. Only the last user message is matched by
//! meaning, inside its partition (namespace, endpoint, model, parameters, conversation
//! context); candidates above the threshold must pass the false-hit gate.

use std::sync::Arc;
use std::time::Instant;

use reprise_cache::semantic::Candidate;
use reprise_cache::{Digest, Entry};
use reprise_embedder::Embedder;
use reprise_policies::semantic::SemanticPolicy;

use crate::lookup::{ms, Notes, Wants};
use crate::state::AppState;

/// The text matched by meaning, where.
pub struct Question<'a> {
    /// The last user message (or the prompt).
    pub text: &'a str,
    /// Its embedding.
    pub embedding: &'a [f32],
    /// Everything that must match exactly.
    pub partition: &'a Digest,
    /// The tenant asking (the embedder's cache scope).
    pub scope: &'a str,
}

/// What became of one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Servable: above the threshold, fresh enough, through the gate.
    Pass,
    /// Below the policy's threshold.
    BelowThreshold,
    /// No tier holds its entry any more (its vector is tombstoned).
    Gone,
    /// Older than the request's `max-age`.
    TooOld,
    /// Reported wrong for this question or one like it (`POST /v1/feedback`).
    Refused,
    /// Rejected by the false-hit gate, with the reason (`substitution` for a substituted
    /// meaning).
    Gate(&'static str),
}

impl Verdict {
    /// A short label (`pass`, `below_threshold`, `gone`, `too_old`, or the gate's reason).
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::BelowThreshold => "below_threshold",
            Verdict::Gone => "gone",
            Verdict::TooOld => "too_old",
            Verdict::Refused => "refused",
            Verdict::Gate(reason) => reason,
        }
    }
}

/// Judges one candidate of `q` found at `similarity`; the entry when one was fetched.
pub async fn judge(
    state: &AppState,
    embedder: &dyn Embedder,
    policy: &SemanticPolicy,
    q: &Question<'_>,
    wants: Wants,
    candidate: &Candidate,
) -> (Verdict, Option<Arc<Entry>>) {
    if candidate.similarity < policy.threshold {
        return (Verdict::BelowThreshold, None);
    }
    let Some(entry) = state.store.fetch(candidate.id).await else {
        return (Verdict::Gone, None);
    };
    if !wants.fresh(&entry) {
        return (Verdict::TooOld, Some(entry));
    }
    if entry.refuses(q.partition, q.embedding, state.config.feedback.radius) {
        return (Verdict::Refused, Some(entry));
    }
    if policy.gate {
        if let Some(reason) = reprise_policies::gate(q.text, &entry.prompt).reason() {
            return (Verdict::Gate(reason), Some(entry));
        }
        let threshold = state.config.semantic.substitution_threshold;
        if substituted_meaning(embedder, q.scope, threshold, q.text, &entry.prompt).await {
            return (Verdict::Gate("substitution"), Some(entry));
        }
    }
    (Verdict::Pass, Some(entry))
}

/// The best servable candidate for `q` under `policy`, with its similarity. Records what it
/// saw in `notes`.
pub async fn find(
    state: &AppState,
    embedder: &dyn Embedder,
    policy: &SemanticPolicy,
    q: Question<'_>,
    wants: Wants,
    notes: &mut Notes,
) -> Option<(Arc<Entry>, f32)> {
    let t = Instant::now();
    let mut found = None;
    for c in state.store.search(q.partition, q.embedding, policy.top_k) {
        if notes.similarity.is_none() {
            notes.similarity = Some(c.similarity);
        }
        match judge(state, embedder, policy, &q, wants, &c).await {
            // Candidates come best first: the rest are below too.
            (Verdict::BelowThreshold, _) => {
                notes.near_miss = Some((c.id, c.similarity));
                break;
            }
            (Verdict::Pass, Some(entry)) => {
                notes.gate = Some("pass");
                notes.similarity = Some(c.similarity);
                found = Some((entry, c.similarity));
                break;
            }
            (Verdict::Gate(reason), _) if notes.gate.is_none() => notes.gate = Some(reason),
            _ => {}
        }
    }
    notes.search_ms = Some(ms(t));
    found
}

/// Whether the two prompts differ by substituted words whose meanings are far apart
/// ("home" vs "car" insurance), judged by the embedder; `threshold` 0 turns the check off.
async fn substituted_meaning(
    embedder: &dyn Embedder,
    scope: &str,
    threshold: f32,
    query: &str,
    candidate: &str,
) -> bool {
    if threshold <= 0.0 {
        return false;
    }
    let Some((a, b)) = reprise_policies::gate::substitution(query, candidate) else {
        return false;
    };
    match embedder.embed_many_in(scope, &[a, b]).await {
        Ok(v) => reprise_embedder::cosine(&v[0], &v[1]) < threshold,
        // Cannot tell: the candidate already passed the threshold and the gate.
        Err(_) => false,
    }
}
