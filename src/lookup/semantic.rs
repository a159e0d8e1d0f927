//! Step 5 of the request path: the semantic lookup. Only the last user message is matched by
//! meaning, inside its partition (namespace, endpoint, model, parameters, conversation
//! context); candidates above the threshold must pass the false-hit gate.

use std::sync::Arc;
use std::time::Instant;

use reprise_cache::semantic::Candidate;
use reprise_cache::{Digest, Entry, EntryId};
use reprise_embedder::Embedder;
use reprise_policies::semantic::SemanticPolicy;

use crate::lookup::{ms, Notes, Wants};
use crate::state::AppState;

/// The text matched by meaning, where.
pub struct Question<'a> {
    /// What the embedder reads of the last user message (or the prompt): the rest is in the
    /// partition.
    pub text: &'a str,
    /// Its embedding.
    pub embedding: &'a [f32],
    /// Everything that must match exactly.
    pub partition: &'a Digest,
    /// The request's exact key (what a refusal of this very question names).
    pub key: &'a Digest,
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

/// Thresholds of entries with verdicts of their own, under a tenant's error bound (see
/// [`crate::bounds::Entries`]): a candidate whose entry has any is judged at its own
/// threshold, the others at the scope's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerEntry {
    /// The tenant's bound.
    pub delta: f64,
    /// The scope's learned threshold, before a client's own raised it.
    pub scope: f32,
    /// The lowest threshold it may learn.
    pub floor: f32,
    /// A client's own threshold (`x-reprise-threshold`): it only ever raises.
    pub requested: Option<f32>,
    /// Only raises count (a canary's candidate, served or shadowed): the entries' right
    /// verdicts were gathered under the running policy (its gate, its rules) and say
    /// nothing of the candidate's, while an answer found wrong is wrong under any policy.
    pub raise_only: bool,
    /// The lookup is counted in the metrics (a client's request, not background work).
    pub counted: bool,
}

impl PerEntry {
    /// The threshold `entry` serves at, when it has verdicts of its own.
    pub fn threshold(&self, state: &AppState, entry: EntryId) -> Option<f32> {
        let l = state
            .bounds
            .entry_threshold(entry, self.delta, self.scope, self.floor)?;
        if self.raise_only && l.threshold <= self.scope {
            return None;
        }
        Some(self.requested.map_or(l.threshold, |r| l.threshold.max(r)))
    }
}

/// The threshold candidate `id` is judged at: its entry's own under `per_entry`, else the
/// policy's.
pub fn threshold_of(
    state: &AppState,
    policy: &SemanticPolicy,
    per_entry: Option<&PerEntry>,
    id: EntryId,
) -> f32 {
    per_entry
        .and_then(|p| p.threshold(state, id))
        .unwrap_or(policy.threshold)
}

/// Whether `similarity` is at or above `threshold`; false for a NaN.
fn reaches(similarity: f32, threshold: f32) -> bool {
    similarity >= threshold
}

/// Judges one candidate of `q` found at `similarity`, at `threshold` (see [`threshold_of`]);
/// the entry when one was fetched.
pub async fn judge(
    state: &AppState,
    embedder: &Arc<dyn Embedder>,
    policy: &SemanticPolicy,
    threshold: f32,
    q: &Question<'_>,
    wants: Wants,
    candidate: &Candidate,
) -> (Verdict, Option<Arc<Entry>>) {
    // Not at or above it (a NaN similarity is not either): never served.
    if !reaches(candidate.similarity, threshold) {
        return (Verdict::BelowThreshold, None);
    }
    let Some(entry) = state.store.fetch(candidate.id).await else {
        return (Verdict::Gone, None);
    };
    if !wants.fresh(&entry) {
        return (Verdict::TooOld, Some(entry));
    }
    // This very question (a refusal made when its neighbourhood could not be embedded has
    // its key only), or one like it.
    if entry.refuses_key(q.key)
        || entry.refuses(q.partition, q.embedding, state.config.feedback.radius)
    {
        return (Verdict::Refused, Some(entry));
    }
    if policy.gate {
        let threshold = state.config.semantic.substitution_threshold;
        // Both prompts are compared on what the embedder reads of them: beyond it they are
        // equal (the partition holds the rest). The gate reads a bounded start of that; only
        // as much of the query is copied for it.
        let query = reprise_policies::gate::capped(q.text).to_owned();
        let (cached, reader) = (entry.clone(), embedder.clone());
        let (verdict, swapped) = state
            .cpu
            .run(move || {
                let (read, _) = reader.split(&cached.prompt);
                vet(&query, read, threshold > 0.0)
            })
            .await;
        if let Some(reason) = verdict.reason() {
            return (Verdict::Gate(reason), Some(entry));
        }
        if let Some(words) = swapped {
            if meanings_apart(embedder.as_ref(), q.scope, threshold, words).await {
                return (Verdict::Gate("substitution"), Some(entry));
            }
        }
    }
    (Verdict::Pass, Some(entry))
}

/// The gate's verdict on `query` against a cached `candidate` and, when it passes and
/// `substitutions` are checked, the words one swaps for the other. CPU-bound: run on
/// [`AppState::cpu`].
pub(crate) fn vet(
    query: &str,
    candidate: &str,
    substitutions: bool,
) -> (reprise_policies::GateVerdict, Option<(String, String)>) {
    let verdict = reprise_policies::gate(query, candidate);
    let swapped = (verdict.is_pass() && substitutions)
        .then(|| reprise_policies::gate::substitution(query, candidate))
        .flatten();
    (verdict, swapped)
}

/// The best servable candidate for `q` under `policy` (and entries' own thresholds, with
/// `per_entry`), with its similarity. Records what it saw in `notes`.
pub async fn find(
    state: &AppState,
    embedder: &Arc<dyn Embedder>,
    policy: &SemanticPolicy,
    per_entry: Option<&PerEntry>,
    q: Question<'_>,
    wants: Wants,
    notes: &mut Notes,
) -> Option<(Arc<Entry>, f32)> {
    let t = Instant::now();
    let mut found = None;
    // A partition waiting for its graph (after a bulk load) is scanned whole: CPU work that
    // grows with it, off the async workers.
    let candidates = {
        let (store, partition, query) = (state.store.clone(), *q.partition, q.embedding.to_vec());
        let k = policy.top_k;
        state
            .cpu
            .run(move || store.search(&partition, &query, k))
            .await
    };
    for c in candidates {
        if notes.similarity.is_none() {
            notes.similarity = Some(c.similarity);
        }
        let threshold = threshold_of(state, policy, per_entry, c.id);
        if threshold != policy.threshold && per_entry.is_some_and(|p| p.counted) {
            // The question's scope is its tenant's name.
            state
                .metrics
                .entry_threshold(q.scope, threshold < policy.threshold);
        }
        match judge(state, embedder, policy, threshold, &q, wants, &c).await {
            (Verdict::BelowThreshold, _) => {
                if notes.near_miss.is_none() {
                    notes.near_miss = Some((c.id, c.similarity));
                }
                // Candidates come best first: under one threshold the rest are below too;
                // an entry of their own may serve at a lower one.
                if per_entry.is_none() {
                    break;
                }
            }
            (Verdict::Pass, Some(entry)) => {
                notes.gate = Some("pass");
                notes.similarity = Some(c.similarity);
                notes.threshold = Some(threshold);
                // Something was served: no near miss to check.
                notes.near_miss = None;
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

/// Whether the words two prompts swap (`words`, "home" vs "car" insurance) are far apart in
/// meaning, judged by the embedder (apart when it cannot tell); `threshold` 0 turns the check
/// off.
pub(crate) async fn meanings_apart(
    embedder: &dyn Embedder,
    scope: &str,
    threshold: f32,
    words: (String, String),
) -> bool {
    if threshold <= 0.0 {
        return false;
    }
    let (a, b) = words;
    match embedder.embed_many_in(scope, &[a, b]).await {
        Ok(v) => reprise_embedder::cosine(&v[0], &v[1]) < threshold,
        // Cannot tell (an overloaded embedder, say): refused, a lost hit rather than a
        // possibly wrong answer.
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reprise_embedder::EmbedError;

    #[test]
    fn a_nan_similarity_reaches_no_threshold() {
        assert!(reaches(0.9, 0.86) && reaches(0.86, 0.86));
        assert!(!reaches(0.85, 0.86));
        assert!(!reaches(f32::NAN, 0.86) && !reaches(f32::NAN, 0.0));
    }

    /// An embedder whose queue is always full.
    struct Overloaded;

    #[async_trait::async_trait]
    impl Embedder for Overloaded {
        async fn embed(&self, _: &str) -> Result<Arc<[f32]>, EmbedError> {
            Err(EmbedError::Overloaded {
                retry_after_secs: 1,
            })
        }
        async fn embed_many(&self, _: &[String]) -> Result<Vec<Arc<[f32]>>, EmbedError> {
            Err(EmbedError::Overloaded {
                retry_after_secs: 1,
            })
        }
        fn dim(&self) -> usize {
            4
        }
        fn fingerprint(&self) -> [u8; 32] {
            [4; 32]
        }
        fn reading(&self, text: &str) -> reprise_embedder::Reading {
            reprise_embedder::Reading::whole(text.len())
        }
    }

    /// When the embedder cannot tell whether swapped words mean the same, they count as
    /// apart: the candidate is refused rather than served on a guess.
    #[tokio::test]
    async fn swapped_words_the_embedder_cannot_judge_count_as_apart() {
        let words = || ("home".to_string(), "car".to_string());
        assert!(meanings_apart(&Overloaded, "", 0.6, words()).await);
        assert!(!meanings_apart(&Overloaded, "", 0.0, words()).await, "off");
    }
}
