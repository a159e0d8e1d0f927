//! Sentence embeddings for reprise.
//!
//! - [`Embedder`]: the trait the server depends on — text in, L2-normalised vector out, so
//!   cosine similarity is a plain dot product — and how much of a text it reads
//!   ([`Embedder::window`]: the model reads a bounded number of tokens).
//! - [`FastEmbedder`]: the local implementation, all-MiniLM-L6-v2 run by ONNX Runtime through
//!   fastembed, with micro-batching of concurrent requests by length under a token and a
//!   working-memory budget, a bounded queue and an LRU of recent texts bounded by bytes.
//! - [`FakeEmbedder`]: a deterministic bag-of-words stand-in for unit tests that must not
//!   load the model (never used by the server).
//! - [`EmbedderConfig`]: where the model and runtime live and how batching behaves.
//! - [`EmbedError`]: everything that can go wrong, with a low-cardinality [`EmbedError::kind`].

mod batch;
mod config;
mod error;
mod fake;
mod fast;
mod memory;
mod window;

use std::sync::Arc;

use async_trait::async_trait;

pub use config::EmbedderConfig;
pub use error::EmbedError;
pub use fake::FakeEmbedder;
pub use fast::{EmbedderStats, FastEmbedder};
pub use window::{model_start, SCAN_BYTES};

/// Turns text into a fixed-size, L2-normalised vector.
///
/// Implementations are shared across request tasks, hence `Send + Sync + 'static`.
#[async_trait]
pub trait Embedder: Send + Sync + 'static {
    /// Embeds one text. The vector has [`Embedder::dim`] components and norm 1.
    async fn embed(&self, text: &str) -> Result<Arc<[f32]>, EmbedError>;

    /// Embeds several texts; the result is in the order of `texts`.
    async fn embed_many(&self, texts: &[String]) -> Result<Vec<Arc<[f32]>>, EmbedError>;

    /// Embeds one text for `scope` (a tenant): an implementation that remembers recent texts
    /// must not answer one scope faster because another asked the same text (the time taken
    /// would tell what another tenant asked). The default has no such memory.
    async fn embed_in(&self, scope: &str, text: &str) -> Result<Arc<[f32]>, EmbedError> {
        let _ = scope;
        self.embed(text).await
    }

    /// [`Embedder::embed_many`] for `scope` (see [`Embedder::embed_in`]).
    async fn embed_many_in(
        &self,
        scope: &str,
        texts: &[String],
    ) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        let _ = scope;
        self.embed_many(texts).await
    }

    /// [`Embedder::embed_many_in`] for work nobody waits on (background checks of answers):
    /// never waits for queue room, and refuses (`Overloaded`) unless at least half of the
    /// queue is free when it asks and such work holds less than half of it (all callers
    /// together), so it leaves clients half the queue. The default has no queue to leave
    /// room in.
    async fn embed_many_spare(
        &self,
        scope: &str,
        texts: &[String],
    ) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        self.embed_many_in(scope, texts).await
    }

    /// Number of components of every vector this embedder returns.
    fn dim(&self) -> usize;

    /// What makes its vectors comparable: equal for two embedders that give the same text the
    /// same vector (the same model files and settings), different otherwise. Vectors stored
    /// by one embedder are only ever compared with queries of an embedder of the same
    /// fingerprint (entries record it, and the index takes only vectors of the running
    /// embedder's), so a changed model, or replicas on different models, never match across.
    fn fingerprint(&self) -> [u8; 32];

    /// What this embedder reads of `text` (see [`Reading`]): how far, and the words within
    /// that it reads as no word in particular. Callers embed `&text[..end]` and match the
    /// rest, and the unknown words, exactly: what the embedder does not read, or reads as
    /// any word alike, cannot tell two texts apart. May tokenize a bounded start of `text`:
    /// CPU work, for a blocking thread rather than an async worker.
    fn reading(&self, text: &str) -> Reading;

    /// The length in bytes of the start of `text` this embedder reads: it reads all of
    /// `&text[..n]`, and `text.len()` means all of `text` ([`Reading::end`]).
    fn window(&self, text: &str) -> usize {
        self.reading(text).end
    }

    /// `text` split where [`Embedder::window`] ends: what the embedder reads, and the rest.
    fn split<'t>(&self, text: &'t str) -> (&'t str, &'t str) {
        text.split_at(self.window(text).min(text.len()))
    }
}

/// What an embedder reads of a text ([`Embedder::reading`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// The length in bytes of the start of the text the embedder reads whole: it reads all
    /// of `&text[..end]`, and the text's length means all of it. Always a character
    /// boundary. An implementation that cannot tell exactly answers less, never more.
    pub end: usize,
    /// Byte ranges within `..end`, in order, of the words the embedder reads as its unknown
    /// token (a character outside its vocabulary, such as most emoji, or an overlong word):
    /// two texts that differ only there get the same vector.
    pub unknown: Vec<std::ops::Range<usize>>,
}

impl Reading {
    /// All of a text of `len` bytes, every word known.
    pub fn whole(len: usize) -> Reading {
        Reading {
            end: len,
            unknown: Vec::new(),
        }
    }

    /// Whether the embedder reads all of a text of `len` bytes, every word known: its
    /// vector tells it apart from any other text.
    pub fn is_whole(&self, len: usize) -> bool {
        self.end >= len && self.unknown.is_empty()
    }

    /// The unknown words of `text` (the text this reading is of).
    pub fn unknown_words<'t>(&self, text: &'t str) -> Vec<&'t str> {
        self.unknown
            .iter()
            .filter_map(|r| text.get(r.clone()))
            .collect()
    }
}

/// Cosine similarity of two L2-normalised vectors (their dot product).
///
/// Panics in debug builds if the lengths differ.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
