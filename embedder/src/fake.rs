//! A deterministic embedder for unit tests that must not load the ONNX model.
//!
//! Each lower-cased word (a run of letters and digits) is hashed with blake3 into one of
//! `dim` buckets with a sign; the sum is L2-normalised. So the same bag of words always gives
//! the same vector, texts sharing most words are close, texts sharing none are near
//! orthogonal, and a test can pin any text to a vector of its choice. It reads every word,
//! or only the first few ([`FakeEmbedder::with_window`]), as the real model reads a bounded
//! number of tokens. It knows nothing of meaning: end-to-end tests use the real model.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use crate::{EmbedError, Embedder};

/// A bag-of-words hashing embedder (see the module header).
pub struct FakeEmbedder {
    dim: usize,
    pinned: HashMap<String, Arc<[f32]>>,
    failing: bool,
    calls: AtomicU64,
    /// Words read of each text (all when `None`).
    window: Option<usize>,
}

impl FakeEmbedder {
    /// An embedder of `dim`-component vectors (at least 2).
    pub fn new(dim: usize) -> Self {
        FakeEmbedder {
            dim: dim.max(2),
            pinned: HashMap::new(),
            failing: false,
            calls: AtomicU64::new(0),
            window: None,
        }
    }

    /// Reads only the first `words` words of each text: the rest does not change its vector.
    pub fn with_window(mut self, words: usize) -> Self {
        self.window = Some(words);
        self
    }

    /// Answers `text` with `vector` (normalised here) instead of hashing its words.
    ///
    /// Panics if `vector` does not have `dim` components.
    pub fn pin(mut self, text: &str, vector: &[f32]) -> Self {
        assert_eq!(
            vector.len(),
            self.dim,
            "a pinned vector needs dim components"
        );
        self.pinned
            .insert(text.to_string(), normalised(vector.to_vec()));
        self
    }

    /// Makes every call fail with [`EmbedError::Inference`].
    pub fn failing(mut self) -> Self {
        self.failing = true;
        self
    }

    /// Texts embedded so far (each text of a batch counts).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn vector(&self, text: &str) -> Result<Arc<[f32]>, EmbedError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.failing {
            return Err(EmbedError::Inference("this embedder is set to fail".into()));
        }
        if let Some(v) = self.pinned.get(text) {
            return Ok(v.clone());
        }
        let text = &text[..self.window(text)];
        let mut v = vec![0f32; self.dim];
        let lower = text.to_lowercase();
        let words = lower
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty());
        let mut any = false;
        for w in words {
            let h = blake3::hash(w.as_bytes());
            let b = h.as_bytes();
            let bucket =
                u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize % self.dim;
            v[bucket] += if b[8] & 1 == 0 { 1.0 } else { -1.0 };
            any = true;
        }
        if !any || v.iter().all(|x| *x == 0.0) {
            // No words (or words that cancel out): a fixed unit vector.
            v[0] = 1.0;
        }
        Ok(normalised(v))
    }
}

fn normalised(mut v: Vec<f32>) -> Arc<[f32]> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v.into()
}

#[async_trait]
impl Embedder for FakeEmbedder {
    async fn embed(&self, text: &str) -> Result<Arc<[f32]>, EmbedError> {
        self.vector(text)
    }

    async fn embed_many(&self, texts: &[String]) -> Result<Vec<Arc<[f32]>>, EmbedError> {
        texts.iter().map(|t| self.vector(t)).collect()
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn fingerprint(&self) -> [u8; 32] {
        // Its vectors depend on its dimension, its window and its pinned texts.
        let mut h = blake3::Hasher::new_derive_key("reprise fake embedder fingerprint v1");
        h.update(&(self.dim as u64).to_le_bytes());
        h.update(&(self.window.map_or(u64::MAX, |w| w as u64)).to_le_bytes());
        let mut pinned: Vec<_> = self.pinned.iter().collect();
        pinned.sort_by(|a, b| a.0.cmp(b.0));
        for (text, v) in pinned {
            h.update(&(text.len() as u64).to_le_bytes());
            h.update(text.as_bytes());
            for x in v.iter() {
                h.update(&x.to_le_bytes());
            }
        }
        *h.finalize().as_bytes()
    }

    fn reading(&self, text: &str) -> crate::Reading {
        crate::Reading {
            end: self.end(text),
            unknown: Vec::new(),
        }
    }
}

impl FakeEmbedder {
    /// Where its window of words ends in `text`.
    fn end(&self, text: &str) -> usize {
        let Some(words) = self.window else {
            return text.len();
        };
        // The end of the last word read: words are runs of letters and digits.
        let mut seen = 0;
        let mut in_word = false;
        for (i, c) in text.char_indices() {
            match (in_word, c.is_alphanumeric()) {
                (false, true) if seen == words => return i,
                (false, true) => {
                    in_word = true;
                    seen += 1;
                }
                (true, false) => in_word = false,
                _ => {}
            }
        }
        text.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cosine;

    #[tokio::test]
    async fn same_words_same_vector_other_words_far() {
        let e = FakeEmbedder::new(256);
        let a = e.embed("How do I reset my password?").await.unwrap();
        let b = e.embed("how do i RESET my password").await.unwrap();
        let c = e.embed("What is the capital of France?").await.unwrap();
        let d = e.embed("How do I reset my router?").await.unwrap();
        assert!((cosine(&a, &b) - 1.0).abs() < 1e-6);
        assert!(cosine(&a, &c) < 0.5, "{}", cosine(&a, &c));
        let ad = cosine(&a, &d);
        assert!(ad > 0.6 && ad < 0.999, "{ad}");
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5);
        assert_eq!(e.calls(), 4);
    }

    #[tokio::test]
    async fn a_window_reads_only_the_first_words() {
        let e = FakeEmbedder::new(64).with_window(3);
        let text = "one two, three four five";
        assert_eq!(e.split(text), ("one two, three ", "four five"));
        let a = e.embed(text).await.unwrap();
        let b = e.embed("One two three and something else").await.unwrap();
        assert!((cosine(&a, &b) - 1.0).abs() < 1e-6);
        assert_eq!(e.window("one two"), 7);
        assert_eq!(FakeEmbedder::new(8).window(text), text.len());
    }

    #[tokio::test]
    async fn pinned_vectors_and_failures() {
        let e = FakeEmbedder::new(2).pin("x", &[3.0, 4.0]);
        assert_eq!(&*e.embed("x").await.unwrap(), &[0.6, 0.8]);
        let many = e.embed_many(&["x".into(), "".into()]).await.unwrap();
        assert_eq!(many.len(), 2);
        assert_eq!(&*many[1], &[1.0, 0.0]);
        let f = FakeEmbedder::new(4).failing();
        assert_eq!(f.embed("x").await.unwrap_err().kind(), "inference");
    }
}
