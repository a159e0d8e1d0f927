//! Where the local model stops reading a text.
//!
//! The model reads at most `max_tokens` tokens, its own special tokens included (fastembed
//! truncates the rest away): for all-MiniLM-L6-v2 at 256, about 250 English words. Two texts
//! that differ only beyond that point get the same vector, so the server must match that part
//! exactly. [`Window::end`] finds the point with the tokenizer the model uses (the same
//! normalisation, pre-tokenisation and vocabulary), not with a character estimate: a
//! character bound safe for every text (one token per byte) would be about 250 bytes, a
//! sixth of what the model reads of English.
//!
//! The tokenizer reads only a bounded start of the text: the first [`SCAN_BYTES`] (2 KiB,
//! then 16 KiB when that held too few tokens), cut at a whitespace. Cut there, the start is
//! tokenized exactly as it is inside the whole text (the BERT normaliser works character by
//! character, and words never span whitespace), so its tokens are the whole text's first
//! tokens. 256 tokens of natural text in any script fit in far less than 16 KiB; a text whose
//! first 16 KiB hold fewer (long runs of whitespace or of one unbroken word) is counted as read
//! up to where the scan ended, which is less than the model reads: the rest is then matched
//! exactly, which is the safe side.
//!
//! Within the window, a word the vocabulary cannot spell (a character outside it, such as
//! most emoji and rare CJK characters, or a word of over 100 characters) is read as the one
//! unknown token: "What does 🦄 mean?" and "What does 🐉 mean?" embed alike, and the gate,
//! which reads letters and digits, sees the same words. [`Window::read`] names those words,
//! and the server matches them exactly as it does the unread rest.

use fastembed::TextEmbedding;
use tokenizers::{PostProcessor, Tokenizer};

use crate::Reading;

/// How far into a text the tokenizer looks for the end of the window, in bytes: a short scan
/// first, a longer one when the short one held too few tokens.
pub const SCAN_BYTES: [usize; 2] = [2 * 1024, 16 * 1024];

/// The start of `text` that is given to the model: at most [`MODEL_BYTES`], cut at a
/// whitespace within its last [`CUT_BACK_BYTES`] (at a character boundary where there is
/// none: a script written without spaces, minified code, would otherwise lose all but its
/// first line). The model reads at most its first `max_tokens` tokens, which natural text
/// in any script holds in far less (four times the longer scan, so a start the window
/// counts as read whole is given whole); past the cut nothing is tokenized (normalising and
/// pre-tokenising megabytes, an answer judged in the background say, would hold the
/// embedding thread and allocate many times their size for a vector that reads the first
/// kilobytes anyway). A text whose first 64 KiB hold fewer tokens than the model reads (a
/// long run of whitespace, one unbroken word) is read as those 64 KiB.
pub fn model_start(text: &str) -> &str {
    let limit = MODEL_BYTES;
    if text.len() <= limit {
        return text;
    }
    let cut = text.floor_char_boundary(limit);
    match text[..cut].rfind(char::is_whitespace) {
        Some(at) if cut - at <= CUT_BACK_BYTES => &text[..at],
        _ => &text[..cut],
    }
}

/// How much of a text [`model_start`] gives the model at most.
pub const MODEL_BYTES: usize = 4 * SCAN_BYTES[1];

/// How far before its end [`model_start`] looks for a whitespace to cut at.
const CUT_BACK_BYTES: usize = 256;

/// The model's tokenizer, without truncation or padding, and how many of a text's tokens the
/// model reads.
pub(crate) struct Window {
    tokenizer: Tokenizer,
    /// Tokens of the text itself the model reads (its maximum minus the special tokens it
    /// adds around them).
    tokens: usize,
    /// The vocabulary's unknown token: every word it stands for reads alike (a word with a
    /// character outside the vocabulary, such as most emoji, or an overlong one).
    unknown: Option<u32>,
}

impl Window {
    /// The window of `model`, which reads at most `max_tokens` tokens.
    pub(crate) fn of(model: &TextEmbedding, max_tokens: usize) -> Self {
        let mut tokenizer = model.tokenizer.clone();
        // fastembed truncates at the smaller of `max_tokens` and the model's own maximum,
        // counting the special tokens the post-processor adds ([CLS] and [SEP]).
        let max_length = tokenizer
            .get_truncation()
            .map_or(max_tokens, |t| t.max_length.min(max_tokens));
        let added = tokenizer
            .get_post_processor()
            .map_or(0, |p| p.added_tokens(false));
        // Without truncation every token of the scanned start comes back with its offsets.
        let _ = tokenizer.with_truncation(None);
        tokenizer.with_padding(None);
        let unknown = ["[UNK]", "<unk>"]
            .iter()
            .find_map(|t| tokenizer.token_to_id(t));
        Window {
            tokenizer,
            tokens: max_length.saturating_sub(added),
            unknown,
        }
    }

    /// Tokens of a text the model reads.
    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    /// What the model reads of `text`: how many bytes of its start (a character boundary;
    /// `text.len()` when it reads all of it; never more than it reads), and where within
    /// them it reads its unknown token.
    pub(crate) fn read(&self, text: &str) -> Reading {
        let mut read = Reading::whole(0);
        for limit in SCAN_BYTES {
            let whole = text.len() <= limit;
            let start = if whole {
                text
            } else {
                let cut = text.floor_char_boundary(limit);
                match text[..cut].rfind(char::is_whitespace) {
                    Some(at) => &text[..at],
                    // No whitespace to cut at: a longer scan may find one.
                    None => continue,
                }
            };
            let Ok(encoding) = self.tokenizer.encode(start, false) else {
                // Cannot tell: what was established stands, the rest is matched exactly.
                return read;
            };
            let offsets = encoding.get_offsets();
            // Offsets are of `start`, a prefix of `text`: they hold for `text`. A word read
            // as the unknown token is one range (a run of them, one each).
            let unknown = encoding.get_ids()[..offsets.len().min(self.tokens)]
                .iter()
                .zip(offsets)
                .filter(|(id, _)| Some(**id) == self.unknown)
                .map(|(_, &(from, to))| from..to)
                .fold(Vec::<std::ops::Range<usize>>::new(), |mut all, r| {
                    match all.last_mut() {
                        Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
                        _ => all.push(r),
                    }
                    all
                });
            if offsets.len() > self.tokens {
                let end = offsets[..self.tokens]
                    .iter()
                    .map(|&(_, end)| end)
                    .max()
                    .unwrap_or(0);
                // A character the normaliser splits into several tokens (a Hangul syllable
                // into its jamo, say) gives each of them its whole span: when the model
                // stops inside such a character, the character is not read whole.
                let unread = offsets[self.tokens].0;
                let end = text.floor_char_boundary(end.min(unread));
                let unknown = unknown.into_iter().filter(|r| r.end <= end).collect();
                return Reading { end, unknown };
            }
            // Every token of `start` is read.
            if whole {
                return Reading {
                    end: text.len(),
                    unknown,
                };
            }
            read = Reading {
                end: start.len(),
                unknown,
            };
        }
        read
    }
}

#[cfg(test)]
mod tests {
    use super::{model_start, MODEL_BYTES};

    #[test]
    fn the_model_start_is_cut_at_a_whitespace_within_its_bound() {
        assert_eq!(model_start("short text"), "short text");
        let long = "word ".repeat(1_000_000);
        let start = model_start(&long);
        assert!(start.len() <= MODEL_BYTES && start.len() > MODEL_BYTES - 8);
        assert!(start.ends_with("word"), "cut at a whitespace");
        // No whitespace: at a character boundary.
        let unbroken = "é".repeat(40_000);
        let start = model_start(&unbroken);
        assert!(start.len() <= MODEL_BYTES && start.len() > MODEL_BYTES - 4);
        // A whitespace only near the start (a heading, then text without spaces): the cut
        // is at a character boundary near the end of the bound, not after the heading.
        let heading = format!("以下是总结：\n{}", "这是一个很长的句子".repeat(3_000));
        let start = model_start(&heading);
        assert!(start.len() > MODEL_BYTES - 4, "{}", start.len());
    }
}
