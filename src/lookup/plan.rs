//! What a write-back stores, gathered while a request is looked up.

use std::sync::Arc;

use reprise_backend::GenRequest;
use reprise_cache::{Digest, EntryId, Origin};

use crate::key::KeyHasher;
use crate::openai::Endpoint;

/// What a write-back stores, gathered along the request path.
#[derive(Debug, Clone)]
pub struct WritePlan {
    /// The id the new entry gets (known before it is generated, so a response can name it).
    pub id: EntryId,
    /// The exact key the new entry is stored under.
    pub exact: Digest,
    /// Tenant.
    pub namespace: String,
    /// Model.
    pub model: String,
    /// The text matched semantically (empty when the request has none).
    pub prompt: String,
    /// How many bytes of `prompt` the embedder reads: the rest is matched exactly (its
    /// digest is in `partition`).
    pub window: usize,
    /// Semantic partition, when the request can be matched semantically.
    pub partition: Option<Digest>,
    /// Embedding of `prompt`.
    pub embedding: Option<Arc<[f32]>>,
    /// Context and query of this turn, to link the answer to the next turn's context.
    pub turn: Option<(Digest, Digest)>,
    /// The context of this turn by the raw text of the earlier exchanges: the answer is
    /// linked under it too (see [`crate::lookup::context::resolve`]).
    pub raw_turn: Option<Digest>,
    /// Live, prefetch or refresh.
    pub origin: Origin,
    /// Report the stored entry to the prefetcher (live requests, when prefetch is on).
    pub observe: Option<ObserveLater>,
    /// Invalidation tags from `x-reprise-tags`.
    pub tags: Vec<String>,
    /// A near miss to check against the answer once generated: see [`crate::bounds`].
    pub near_miss: Option<crate::bounds::NearMiss>,
}

/// What the prefetcher is told about a miss once its answer is stored.
#[derive(Debug, Clone)]
pub struct ObserveLater {
    /// Endpoint of the request.
    pub endpoint: Endpoint,
    /// The request as asked.
    pub request: GenRequest,
    /// Session id (`x-reprise-session` or the `user` field).
    pub session: Option<String>,
    /// The entry that answered the previous turn.
    pub prev_entry: Option<EntryId>,
}

impl WritePlan {
    /// A plan for storing the answer to `req` under `exact` in `namespace`; the lookup fills
    /// in the rest.
    pub fn new(exact: Digest, namespace: &str, req: &GenRequest) -> Self {
        WritePlan {
            id: EntryId::random(),
            exact,
            namespace: namespace.to_string(),
            model: req.model.clone(),
            prompt: String::new(),
            window: 0,
            partition: None,
            embedding: None,
            turn: None,
            raw_turn: None,
            origin: Origin::Live,
            observe: None,
            tags: Vec::new(),
            near_miss: None,
        }
    }

    /// The part of `prompt` matched by meaning: what the embedder reads of it.
    pub fn read(&self) -> &str {
        &self.prompt[..self.window]
    }

    /// The key that links "this context, this query, this answer" to the entry that answered,
    /// so a later turn whose history contains this exchange resolves its context to the entry.
    pub fn turn_key(&self, answer: &str) -> Option<Digest> {
        let (context, query) = self.turn?;
        Some(turn_key(
            &self.namespace,
            &self.model,
            &context,
            &query,
            answer,
        ))
    }

    /// The turn link, and the link under the raw history when the context was resolved
    /// to something else.
    pub fn turn_keys(&self, answer: &str) -> Vec<Digest> {
        let Some(link) = self.turn_key(answer) else {
            return Vec::new();
        };
        let mut keys = vec![link];
        if let (Some(raw), Some((context, query))) = (self.raw_turn, self.turn) {
            if raw != context {
                keys.push(turn_key(&self.namespace, &self.model, &raw, &query, answer));
            }
        }
        keys
    }

    /// Every key the new entry is stored under: the exact key, then the turn links.
    pub fn keys(&self, answer: &str) -> Vec<Digest> {
        let mut keys = vec![self.exact];
        keys.extend(self.turn_keys(answer));
        keys
    }
}

/// The turn link of an exchange (see [`WritePlan::turn_key`]).
pub(crate) fn turn_key(
    namespace: &str,
    model: &str,
    context: &Digest,
    query: &Digest,
    answer: &str,
) -> Digest {
    let mut h = KeyHasher::new("turn");
    h.str(namespace)
        .str(model)
        .digest(context)
        .digest(query)
        .str(answer);
    h.finish()
}
