//! Turning a sequence's token bytes into client-visible text.
//!
//! Two things make this more than `String::from_utf8`: a token can end in the middle of a
//! multi-byte character, and a stop string can span several tokens. [`TextStream`] buffers
//! incomplete UTF-8 sequences until the rest arrives and holds back any suffix that could be
//! the beginning of a stop string, so neither a broken character nor any part of a stop
//! string is ever emitted.

/// What one [`TextStream::push`] produced.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Pushed {
    /// Text that is final and can be sent to the client.
    pub emit: String,
    /// A stop string was found; `emit` ends right before it and the generation is over.
    pub stopped: bool,
}

/// Incremental UTF-8 decoder with stop-string hold-back for one sequence.
#[derive(Debug, Default)]
pub(crate) struct TextStream {
    /// Bytes of an incomplete UTF-8 character at the end of the output so far.
    partial: Vec<u8>,
    /// Decoded text not yet emitted because it could be the start of a stop string.
    held: String,
    /// Non-empty stop strings.
    stops: Vec<String>,
}

impl TextStream {
    /// A stream that ends generation at the first occurrence of any of `stops`.
    pub(crate) fn new(stops: Vec<String>) -> Self {
        Self {
            partial: Vec::new(),
            held: String::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
        }
    }

    /// Appends one token's bytes and returns the text that became final.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Pushed {
        self.partial.extend_from_slice(bytes);
        self.decode_partial();

        if let Some(at) = self.first_stop() {
            let emit = self.held[..at].to_owned();
            // Nothing after the stop is output, the start of a character included.
            self.held.clear();
            self.partial.clear();
            return Pushed {
                emit,
                stopped: true,
            };
        }
        let keep = self.stop_prefix_len();
        let emit = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        Pushed {
            emit,
            stopped: false,
        }
    }

    /// Ends the stream (end of sequence, length limit) and returns everything still held:
    /// a held-back partial stop string is real output once no more text can follow, and
    /// trailing bytes of a character that never completed become U+FFFD.
    pub(crate) fn finish(&mut self) -> String {
        let mut out = std::mem::take(&mut self.held);
        if !self.partial.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.partial));
            self.partial.clear();
        }
        out
    }

    /// Moves every complete character from `partial` to `held`. Invalid bytes (which a
    /// tokenizer should never produce) become U+FFFD rather than stalling the stream.
    fn decode_partial(&mut self) {
        loop {
            match std::str::from_utf8(&self.partial) {
                Ok(s) => {
                    self.held.push_str(s);
                    self.partial.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // `valid_up_to` guarantees this prefix is valid, so nothing is replaced.
                    self.held
                        .push_str(&String::from_utf8_lossy(&self.partial[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            self.held.push(char::REPLACEMENT_CHARACTER);
                            self.partial.drain(..valid + bad);
                        }
                        None => {
                            // Incomplete character at the end: wait for the next token.
                            self.partial.drain(..valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Byte offset of the earliest stop-string occurrence in `held`.
    fn first_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn stop_prefix_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                // Only suffixes as long as what is held can match.
                (1..stop.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&k| stop.is_char_boundary(k) && self.held.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (String, bool) {
        let mut t = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = t.push(p);
            out.push_str(&r.emit);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&t.finish());
        (out, false)
    }

    #[test]
    fn split_multibyte_character_is_emitted_whole() {
        let euro = "€".as_bytes();
        let mut t = TextStream::new(vec![]);
        assert_eq!(t.push(&euro[..1]).emit, "");
        assert_eq!(t.push(&euro[1..2]).emit, "");
        assert_eq!(t.push(&euro[2..]).emit, "€");
    }

    #[test]
    fn stop_string_across_tokens_is_not_emitted() {
        assert_eq!(
            run(&["STOP"], &[b"hello S", b"TO", b"P world"]),
            ("hello ".into(), true)
        );
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let mut t = TextStream::new(vec!["STOP".into()]);
        assert_eq!(t.push(b"a ST").emit, "a ");
        assert_eq!(t.push(b"ORM").emit, "STORM");
    }

    #[test]
    fn finish_flushes_held_prefix_and_broken_bytes() {
        assert_eq!(run(&["STOP"], &[b"x ST"]), ("x ST".into(), false));
        assert_eq!(
            run(&[], &[b"a", &[0xE2, 0x82]]),
            ("a\u{FFFD}".into(), false)
        );
    }

    #[test]
    fn nothing_after_a_stop_is_output_not_even_half_a_character() {
        // The token holding the stop also starts a three-byte character ("—").
        let mut t = TextStream::new(vec![" ".into()]);
        let p = t.push(b"a \xE2");
        assert!(p.stopped);
        assert_eq!(p.emit, "a");
        assert_eq!(t.finish(), "");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["cd", "b"], &[b"abcdef"]), ("a".into(), true));
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        assert_eq!(
            run(&[], &[&[b'a', 0xFF, b'b']]),
            ("a\u{FFFD}b".into(), false)
        );
    }
}
