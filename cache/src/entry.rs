//! Cached entries and their ids.
//!
//! An [`Entry`] is one finished answer: the text, why it ended, its token usage, and what is
//! needed to serve it again (the partition it may be matched in, the prompt text that was
//! embedded) plus bookkeeping (origin, created and expiry times).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::vector::Vector;

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

/// What malloc adds to an allocation on average (its header and the rounding up to 16
/// bytes), counted in [`Entry::weight`].
const MALLOC_CHUNK: usize = 16;

/// Refusals kept per entry.
pub const MAX_REFUSALS: usize = 32;

/// Most questions an entry keeps refusing by their exact key alone, once it refuses every
/// question by meaning (past [`MAX_REFUSALS`]): beyond, the entry is deleted.
pub const MAX_KEY_REFUSALS: usize = 256;

/// A question an entry was reported wrong for: it is never served again to that question
/// (by its exact key), nor to the questions around it in the same partition (when the
/// question was matched by meaning).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refusal {
    /// The question's exact key: it no longer leads to the entry.
    pub key: Digest,
    /// The partition the question was asked in and its embedding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub around: Option<(Digest, Vector)>,
}

/// What [`Entry::merge_refusals`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The other copy refuses nothing this one does not.
    Same,
    /// Refusals were taken in.
    Added,
    /// The copies together refuse more questions than one can keep: delete the entry.
    Full,
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
    pub embedding: Option<Vector>,
    /// The fingerprint of the embedder that made `embedding`
    /// (`reprise_embedder::Embedder::fingerprint`): only an index of the same embedder takes
    /// the vector. Absent on entries stored before it was recorded, which are taken as the
    /// configured embedder's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedder: Option<Digest>,
    /// Where the entry came from.
    pub origin: Origin,
    /// Labels for invalidation by tag (`x-reprise-tags` on the request that created it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Questions this entry must not answer (reported wrong): each is a neighbourhood of a
    /// question in one partition; past [`MAX_REFUSALS`], see [`Entry::refused_by_meaning`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refusals: Vec<Refusal>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// Expiry time, milliseconds since the Unix epoch.
    pub expires_ms: u64,
    /// How long the backend took to generate it, in milliseconds (0: not known, e.g. an
    /// entry stored before this was recorded): the backend time a hit on it saves.
    #[serde(default)]
    pub gen_ms: u32,
}

impl Entry {
    /// Approximate heap size in bytes, used to bound the memory tier.
    pub fn weight(&self) -> u32 {
        let emb = self.embedding.as_ref().map_or(0, Vector::heap_bytes);
        let refusals: usize = self
            .refusals
            .iter()
            .map(|r| {
                std::mem::size_of::<Refusal>()
                    + r.around.as_ref().map_or(0, |(_, e)| e.heap_bytes())
            })
            .sum();
        let tags: usize = self
            .tags
            .iter()
            .map(|t| std::mem::size_of::<String>() + t.capacity())
            .sum();
        // malloc's header and rounding, per allocation: the entry's `Arc`, five strings, the
        // embedding, each tag and refusal.
        let allocations = 7 + self.tags.len() + 2 * self.refusals.len();
        // What the strings allocated, not only what they use.
        let bytes = allocations * MALLOC_CHUNK
            + std::mem::size_of::<Entry>()
            + refusals
            + self.namespace.capacity()
            + self.model.capacity()
            + self.text.capacity()
            + self.finish_reason.capacity()
            + self.prompt.capacity()
            + emb
            + tags;
        u32::try_from(bytes).unwrap_or(u32::MAX)
    }

    /// Whether the entry was reported wrong for a question like `query` (cosine similarity
    /// at least `radius`) in `partition`.
    pub fn refuses(&self, partition: &Digest, query: &[f32], radius: f32) -> bool {
        self.refused_by_meaning()
            || self.refusals.iter().any(|r| match &r.around {
                Some((p, e)) => {
                    p == partition && e.len() == query.len() && e.cosine(query) >= radius
                }
                None => false,
            })
    }

    /// Whether some refusal holds a neighbourhood (a question refused by meaning): a wording
    /// linked to the entry before it, within that neighbourhood, must be matched again.
    pub fn refuses_around(&self) -> bool {
        self.refusals.iter().any(|r| r.around.is_some())
    }

    /// Whether the entry was reported wrong for the question of exact key `key`.
    pub fn refuses_key(&self, key: &Digest) -> bool {
        self.refusals.iter().any(|r| r.key == *key)
    }

    /// Reported wrong for more than [`MAX_REFUSALS`] questions: served by meaning to no
    /// question any more (its exact keys still answer, but those of the questions refused),
    /// its refusals keeping only their keys. Dropping the oldest refusal instead would let
    /// one client's verdicts undo the others'.
    pub fn refused_by_meaning(&self) -> bool {
        self.refusals.len() > MAX_REFUSALS
    }

    /// Adds a refusal; one for a key already refused changes nothing. Past [`MAX_REFUSALS`]
    /// the entry is refused to every question by meaning ([`Entry::refused_by_meaning`]) and
    /// keeps refusing keys alone, up to [`MAX_KEY_REFUSALS`]; `false` when it can keep no more
    /// (see [`Entry::refusals_full`]). Whether it was added.
    pub fn refuse(&mut self, refusal: Refusal) -> bool {
        if self.refuses_key(&refusal.key) || self.refusals_full() {
            return false;
        }
        if self.refusals.len() < MAX_REFUSALS {
            self.refusals.push(refusal);
            return true;
        }
        // Every neighbourhood is refused now: their vectors would only take room.
        for r in &mut self.refusals {
            r.around = None;
        }
        self.refusals.push(Refusal {
            key: refusal.key,
            around: None,
        });
        true
    }

    /// Whether it refuses as many questions as it can keep: one more wrong verdict deletes
    /// it.
    pub fn refusals_full(&self) -> bool {
        self.refusals.len() >= MAX_KEY_REFUSALS
    }

    /// Takes in `other`'s refusals this copy lacks (copies of one entry on two replicas may
    /// each have learned some). [`Merged::Full`] when the two together refuse more questions
    /// than one copy can keep: some refusal would be lost, so the entry must go (fail
    /// closed, as one more wrong verdict on a full entry deletes it).
    pub fn merge_refusals(&mut self, other: &Entry) -> Merged {
        let mut merged = Merged::Same;
        for r in &other.refusals {
            if self.refuse(r.clone()) {
                merged = Merged::Added;
            } else if !self.refuses_key(&r.key) {
                return Merged::Full;
            }
        }
        merged
    }

    /// Time left before expiry (zero when expired).
    pub fn ttl_left(&self) -> Duration {
        Duration::from_millis(self.expires_ms.saturating_sub(now_ms()))
    }

    /// Seconds since creation, for the `Age` header.
    pub fn age_secs(&self) -> u64 {
        now_ms().saturating_sub(self.created_ms) / 1000
    }

    /// Whether the entry has expired. An expired entry is never fresh; it may still be
    /// kept for a while to be served stale (see [`Entry::kept_left`]).
    pub fn is_expired(&self) -> bool {
        now_ms() >= self.expires_ms
    }

    /// Milliseconds since the entry expired (0 while it has not).
    pub fn expired_for_ms(&self) -> u64 {
        now_ms().saturating_sub(self.expires_ms)
    }

    /// Time left before a tier that keeps expired entries for `retain_ms` past their expiry
    /// (to serve them stale) drops this one.
    pub fn kept_left(&self, retain_ms: u64) -> Duration {
        let until = self.expires_ms.saturating_add(retain_ms);
        Duration::from_millis(until.saturating_sub(now_ms()))
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

    fn entry() -> Entry {
        Entry {
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
            embedder: None,
            origin: Origin::Live,
            tags: Vec::new(),
            refusals: Vec::new(),
            created_ms: 0,
            expires_ms: 1,
            gen_ms: 0,
        }
    }

    #[test]
    fn weight_counts_text_embedding_and_tags() {
        let mut e = entry();
        let bare = e.weight();
        e.embedding = Some(Vector::from(vec![0.0; 384]));
        let arc = 2 * std::mem::size_of::<usize>();
        assert_eq!(e.weight() as usize, bare as usize + arc + 384 * 2);
        let with_embedding = e.weight();
        e.tags = vec!["x".repeat(128); 32];
        let per_tag = MALLOC_CHUNK + std::mem::size_of::<String>() + 128;
        assert_eq!(e.weight() as usize, with_embedding as usize + 32 * per_tag);
        let with_tags = e.weight();
        e.refuse(Refusal {
            key: [1; 32],
            around: Some(([2; 32], Vector::from(vec![0.0; 384]))),
        });
        let per_refusal = 2 * MALLOC_CHUNK + std::mem::size_of::<Refusal>() + arc + 384 * 2;
        assert_eq!(e.weight() as usize, with_tags as usize + per_refusal);
    }

    #[test]
    fn refusals_cover_the_key_and_the_neighbourhood_in_one_partition() {
        let mut e = entry();
        let q = [1.0, 0.0];
        e.refuse(Refusal {
            key: [1; 32],
            around: Some(([2; 32], Vector::new(&q))),
        });
        assert!(e.refuses_key(&[1; 32]) && !e.refuses_key(&[3; 32]));
        assert!(e.refuses(&[2; 32], &[0.95, 0.1], 0.9));
        assert!(!e.refuses(&[2; 32], &[0.5, 0.8], 0.9), "outside the radius");
        assert!(!e.refuses(&[4; 32], &q, 0.9), "another partition");
        assert!(
            !e.refuse(Refusal {
                key: [1; 32],
                around: None,
            }),
            "a key refused once is refused once"
        );
        for i in 0..MAX_REFUSALS as u8 - 1 {
            e.refuse(Refusal {
                key: [10 + i; 32],
                around: Some(([2; 32], Vector::new(&q))),
            });
        }
        assert_eq!(e.refusals.len(), MAX_REFUSALS);
        assert!(!e.refused_by_meaning());
        assert!(e.refuse(Refusal {
            key: [100; 32],
            around: Some(([2; 32], Vector::new(&q))),
        }));
        assert!(e.refuses_key(&[100; 32]), "the question refused last");
        // Past the limit no refusal is dropped (one client's verdicts cannot undo the
        // others'): the entry is no longer served by meaning at all, and the question
        // refused last is refused by its key.
        assert!(e.refuses_key(&[1; 32]), "the oldest is kept");
        assert!(e.refused_by_meaning());
        assert!(e.refuses(&[4; 32], &q, 0.9), "to no question by meaning");
        assert!(!e.refuses_key(&[99; 32]), "its own question still answers");
        assert!(e.refusals.iter().all(|r| r.around.is_none()), "keys alone");
        let mut n = 0u32;
        while !e.refusals_full() {
            let mut key = [0u8; 32];
            key[..4].copy_from_slice(&(1000 + n).to_le_bytes());
            assert!(e.refuse(Refusal { key, around: None }));
            assert!(e.refuses_key(&key));
            n += 1;
        }
        assert_eq!(e.refusals.len(), MAX_KEY_REFUSALS);
        assert!(!e.refuse(Refusal {
            key: [200; 32],
            around: None,
        }));
        // Copies of the entry on other replicas learn it.
        let mut other = entry();
        assert_eq!(other.merge_refusals(&e), Merged::Added);
        assert!(other.refused_by_meaning());
        assert_eq!(other.merge_refusals(&e), Merged::Same, "nothing new");
        // A copy that refused one question the full one does not: together they refuse
        // more than one copy keeps, and neither may drop a refusal.
        let mut apart = entry();
        apart.refuse(Refusal {
            key: [201; 32],
            around: None,
        });
        assert_eq!(apart.clone().merge_refusals(&e), Merged::Full);
        assert_eq!(e.clone().merge_refusals(&apart), Merged::Full);
    }
}
