//! Cached entries and their ids.
//!
//! An [`Entry`] is one finished answer: the text, why it ended, its token usage, and what is
//! needed to serve it again (the partition it may be matched in, the prompt text that was
//! embedded) plus bookkeeping (origin, created and expiry times).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A 32-byte digest: exact keys, aliases and semantic partitions are all of this shape.
pub type Digest = [u8; 32];

/// Globally unique id of a cache entry (random, so replicas never collide).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EntryId(pub u128);

impl EntryId {
    /// A fresh random id.
    pub fn random() -> Self {
        EntryId(uuid::Uuid::new_v4().as_u128())
    }
}

impl std::fmt::Display for EntryId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::str::FromStr for EntryId {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u128::from_str_radix(s, 16).map(EntryId)
    }
}

/// Where an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Generated for a waiting client.
    #[default]
    Live,
    /// Generated ahead of time for a predicted follow-up.
    Prefetch,
    /// Regenerated before expiry (refresh-ahead).
    Refresh,
}

impl Origin {
    /// Low-cardinality label.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Live => "live",
            Origin::Prefetch => "prefetch",
            Origin::Refresh => "refresh",
        }
    }
}

/// One finished answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Unique id.
    pub id: EntryId,
    /// Tenant namespace the entry belongs to.
    pub namespace: String,
    /// Model that produced it.
    pub model: String,
    /// The answer text.
    pub text: String,
    /// OpenAI finish reason (`stop`, `length`, ...).
    pub finish_reason: String,
    /// Prompt tokens of the original generation.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// The text matched semantically: the last user turn (chat) or the raw prompt.
    pub prompt: String,
    /// Semantic partition: digest of everything that must match exactly (namespace, model,
    /// output-affecting parameters, conversation context).
    pub partition: Digest,
    /// The prompt's embedding, when the semantic tier computed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Arc<[f32]>>,
    /// Where the entry came from.
    pub origin: Origin,
    /// Labels for invalidation by tag (`x-reprise-tags` on the request that created it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// Expiry time, milliseconds since the Unix epoch.
    pub expires_ms: u64,
}

impl Entry {
    /// Approximate heap size in bytes, used to bound the memory tier.
    pub fn weight(&self) -> u32 {
        let emb = self.embedding.as_ref().map_or(0, |e| e.len() * 4);
        let tags: usize = self
            .tags
            .iter()
            .map(|t| std::mem::size_of::<String>() + t.len())
            .sum();
        let bytes = std::mem::size_of::<Entry>()
            + self.namespace.len()
            + self.model.len()
            + self.text.len()
            + self.finish_reason.len()
            + self.prompt.len()
            + emb
            + tags;
        u32::try_from(bytes).unwrap_or(u32::MAX)
    }

    /// Time left before expiry (zero when expired).
    pub fn ttl_left(&self) -> Duration {
        Duration::from_millis(self.expires_ms.saturating_sub(now_ms()))
    }

    /// Seconds since creation, for the `Age` header.
    pub fn age_secs(&self) -> u64 {
        now_ms().saturating_sub(self.created_ms) / 1000
    }

    /// Whether the entry has expired.
    pub fn is_expired(&self) -> bool {
        now_ms() >= self.expires_ms
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_counts_text_embedding_and_tags() {
        let mut e = Entry {
            id: EntryId(1),
            namespace: "ns".into(),
            model: "m".into(),
            text: "answer".into(),
            finish_reason: "stop".into(),
            prompt_tokens: 1,
            completion_tokens: 1,
            prompt: "question".into(),
            partition: [0; 32],
            embedding: None,
            origin: Origin::Live,
            tags: Vec::new(),
            created_ms: 0,
            expires_ms: 1,
        };
        let bare = e.weight();
        e.embedding = Some(Arc::from(vec![0.0; 384]));
        assert_eq!(e.weight(), bare + 384 * 4);
        let with_embedding = e.weight();
        e.tags = vec!["x".repeat(128); 32];
        let per_tag = std::mem::size_of::<String>() + 128;
        assert_eq!(e.weight() as usize, with_embedding as usize + 32 * per_tag);
    }
}
