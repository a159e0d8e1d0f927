//! Predictive prefetch (in progress): learns which follow-ups come after which answers and
//! generates likely follow-ups in the background.

use std::sync::Arc;

use reprise_backend::GenRequest;
use reprise_cache::{Entry, EntryId};
use serde::Deserialize;

use crate::openai::Endpoint;

/// `[prefetch]`
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefetchConfig {
    /// Predict follow-ups and generate them in the background.
    pub enabled: bool,
}

/// One served request, as the prefetcher learns from it.
#[derive(Debug, Clone)]
pub struct Observation {
    /// Tenant.
    pub namespace: String,
    /// Endpoint of the request.
    pub endpoint: Endpoint,
    /// The request as asked.
    pub request: GenRequest,
    /// Session id (`x-reprise-session` or the `user` field).
    pub session: Option<String>,
    /// The entry that answered the previous turn of the conversation, when reprise served it.
    pub prev_entry: Option<EntryId>,
    /// The entry that answered this request.
    pub entry: Arc<Entry>,
}

/// Handle to the prefetcher.
pub struct Prefetcher {}

impl Prefetcher {
    /// A prefetcher (not yet running).
    pub fn new(_cfg: PrefetchConfig) -> Arc<Prefetcher> {
        Arc::new(Prefetcher {})
    }

    /// Starts the background worker.
    pub fn start(&self, _state: std::sync::Weak<crate::state::AppState>) {}

    /// Records a served request (never blocks).
    pub fn observe(&self, _obs: Observation) {}

    /// Records the first use of a prefetched entry.
    pub fn used(&self, _id: EntryId) {}
}
