//! What the prefetcher did lately, kept within a byte bound for diagnostics: the jobs that
//! finished ([`FinishedJob`]) and the predictions made after each answer
//! ([`PredictionRecord`]). `reprise-bench replay` reads both to tell where prefetch's gain
//! was lost.

use std::collections::VecDeque;
use std::time::Instant;

use reprise_backend::{GenRequest, Input};

/// Bytes of each record ([`Prefetcher::finished_jobs`](super::Prefetcher::finished_jobs),
/// [`Prefetcher::predictions_made`](super::Prefetcher::predictions_made)): their texts, each
/// at most [`TEXT_BYTES`], at most [`QUESTIONS`] questions a record, and a fixed overhead
/// each; the oldest go first.
pub(super) const RECORD_BYTES: usize = 4 * 1024 * 1024;
/// The longest text kept (cut at a character boundary).
pub(super) const TEXT_BYTES: usize = 512;
/// The most questions of a request kept (the last ones).
pub(super) const QUESTIONS: usize = 16;
/// Counted per record besides its texts.
const RECORD_OVERHEAD: usize = 96;
/// Counted per text besides its bytes.
const TEXT_OVERHEAD: usize = 24;

/// A prefetch job that finished: what it asked and how it ended.
#[derive(Debug, Clone)]
pub struct FinishedJob {
    /// When it finished.
    pub at: Instant,
    /// Its namespace.
    pub namespace: String,
    /// The user messages of its request, the predicted question last (the last 16, each cut
    /// to its first 512 bytes).
    pub questions: Vec<String>,
    /// How it ended: the answer was `generated`, the cache held one already (`cached`), or
    /// nothing was stored (`failed`, `skipped`).
    pub outcome: &'static str,
}

/// The prediction made after an answer was learned: what it rested on, what it kept and
/// what it passed over.
#[derive(Debug, Clone)]
pub struct PredictionRecord {
    /// When it was made.
    pub at: Instant,
    /// Its namespace.
    pub namespace: String,
    /// The user messages of the answered request (its question last): the context of the
    /// follow-ups predicted (the last 16, each cut to its first 512 bytes).
    pub questions: Vec<String>,
    /// What the counts came from: `entry`, `cluster`, `similar`, or nothing predicted for
    /// `too_few` observations (or an `unknown` entry).
    pub basis: &'static str,
    /// The follow-ups kept (each cluster's wording asked, most probable first).
    pub kept: Vec<String>,
    /// The most probable follow-ups not kept (at most 8): wording, probability and why
    /// (`min_probability`, `max_predictions`).
    pub passed_over: Vec<(String, f64, &'static str)>,
}

/// A text as records keep it.
pub(super) fn cut(text: &str) -> String {
    text[..text.floor_char_boundary(TEXT_BYTES)].to_string()
}

/// The user messages of `request` as records keep them: the last [`QUESTIONS`], cut.
pub(super) fn questions_of(request: &GenRequest) -> Vec<String> {
    let mut questions: Vec<String> = match &request.input {
        Input::Chat(messages) => {
            let users: Vec<&str> = messages
                .iter()
                .filter(|m| m.role == "user")
                .map(|m| m.content.as_str())
                .collect();
            let from = users.len().saturating_sub(QUESTIONS);
            users[from..].iter().map(|t| cut(t)).collect()
        }
        Input::Prompt(p) => vec![cut(p)],
    };
    questions.shrink_to_fit();
    questions
}

/// What a record weighs against [`RECORD_BYTES`].
pub(super) trait Weighed {
    fn weight(&self) -> usize;
}

fn texts_weight<'a>(texts: impl IntoIterator<Item = &'a String>) -> usize {
    texts.into_iter().map(|t| t.len() + TEXT_OVERHEAD).sum()
}

impl Weighed for FinishedJob {
    fn weight(&self) -> usize {
        self.namespace.len() + texts_weight(&self.questions) + RECORD_OVERHEAD
    }
}

impl Weighed for PredictionRecord {
    fn weight(&self) -> usize {
        self.namespace.len()
            + texts_weight(&self.questions)
            + texts_weight(&self.kept)
            + texts_weight(self.passed_over.iter().map(|p| &p.0))
            + RECORD_OVERHEAD
    }
}

/// The latest records within [`RECORD_BYTES`], oldest first.
pub(super) struct Recent<T> {
    items: VecDeque<T>,
    bytes: usize,
}

impl<T: Weighed + Clone> Recent<T> {
    pub(super) fn new() -> Self {
        Recent {
            items: VecDeque::new(),
            bytes: 0,
        }
    }

    /// Keeps `item`, forgetting the oldest past the bound.
    pub(super) fn push(&mut self, item: T) {
        self.bytes += item.weight();
        self.items.push_back(item);
        while self.bytes > RECORD_BYTES {
            let Some(old) = self.items.pop_front() else {
                break;
            };
            self.bytes -= old.weight();
        }
    }

    pub(super) fn to_vec(&self) -> Vec<T> {
        self.items.iter().cloned().collect()
    }

    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}
