//! Step 5 of the request path: the semantic lookup. Only the last user message is matched by
//! meaning, inside its partition (namespace, endpoint, model, parameters, conversation
//! context); candidates above the threshold must pass the false-hit gate.

use std::sync::Arc;
use std::time::Instant;

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
    let query = q.text;
    let t = Instant::now();
    let substitution_threshold = state.config.semantic.substitution_threshold;
    let mut found = None;
    for c in state.store.search(q.partition, q.embedding, policy.top_k) {
        if notes.similarity.is_none() {
            notes.similarity = Some(c.similarity);
        }
        if c.similarity < policy.threshold {
            break;
        }
        let Some(entry) = state.store.fetch(c.id).await else {
            continue;
        };
        if !wants.fresh(&entry) {
            continue;
        }
        if policy.gate {
            let verdict = reprise_policies::gate(query, &entry.prompt);
            if !verdict.is_pass() {
                if notes.gate.is_none() {
                    notes.gate = verdict.reason();
                }
                continue;
            }
            if substituted_meaning(
                embedder,
                q.scope,
                substitution_threshold,
                query,
                &entry.prompt,
            )
            .await
            {
                if notes.gate.is_none() {
                    notes.gate = Some("substitution");
                }
                continue;
            }
        }
        notes.gate = Some("pass");
        notes.similarity = Some(c.similarity);
        found = Some((entry, c.similarity));
        break;
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
