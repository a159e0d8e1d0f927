//! The surface features of one prompt that the gate compares: its words (tokenised, with
//! sentence and clause starts), numbers (digits, number words, times, ordinals), date
//! words, negations, entities (capitalised words), quoted strings, and content words with
//! phrasal verbs joined.

use super::lexicon::{
    is_negation, ordinal_word, scale_word, strip_possessive, unit_word, DATES, NOT_ENTITIES,
    PARTICLES, PHRASAL_VERBS,
};

/// One word of a prompt.
#[derive(Debug, Clone)]
pub(super) struct Token {
    /// Lower-cased, apostrophes normalised, possessive `'s` kept.
    pub(super) lower: String,
    /// Has an upper-case letter somewhere (Paris, macOS, UK).
    pub(super) cased: bool,
    /// First word of the text or of a sentence (after . ! ? : ;).
    pub(super) sentence_start: bool,
    /// First word after any punctuation (a clause boundary).
    pub(super) clause_start: bool,
}

/// What the rules look at, computed once per prompt.
#[derive(Debug, Default)]
pub(super) struct Features {
    /// The prompt's words, in order.
    pub(super) tokens: Vec<Token>,
    /// Normalised numbers ("50", "7pm", "9:15", "3rd").
    pub(super) numbers: Vec<String>,
    /// How many of `numbers` came from the word "one" (often a pronoun: "quick one").
    pub(super) ones_from_word: usize,
    /// Weekdays, months, relative days ("sunday", "tomorrow", "weekend").
    pub(super) dates: Vec<&'static str>,
    /// Negations counted; only their parity matters.
    pub(super) negations: usize,
    /// Lower-cased capitalised words, when the text's case carries information.
    pub(super) entities: Vec<String>,
    /// Contents of double quotes or backticks.
    pub(super) quotes: Vec<String>,
    /// Lower-cased words with possessives stripped and phrasal verbs joined ("opt_in").
    pub(super) words: Vec<String>,
}

impl Features {
    /// Extracts the features of one prompt.
    pub(super) fn of(text: &str) -> Features {
        let tokens = tokenize(text);
        super::steps(tokens.len());
        let mut f = Features {
            quotes: quoted(text),
            ..Features::default()
        };

        // A text in all caps or Title Case carries no case information: then only the other
        // side's entities are checked (against this side's words).
        let inner: Vec<&Token> = tokens
            .iter()
            .filter(|t| {
                !t.sentence_start
                    && t.lower.chars().next().is_some_and(char::is_alphabetic)
                    && !NOT_ENTITIES.contains(&t.lower.as_str())
            })
            .collect();
        let capitalised = inner.iter().filter(|t| t.cased).count();
        let caseless = !text.chars().any(char::is_lowercase)
            || (inner.len() >= 3 && capitalised * 5 > inner.len() * 3);

        let mut words: Vec<String> = Vec::with_capacity(tokens.len());
        let mut i = 0;
        while i < tokens.len() {
            let t = &tokens[i];
            let w = strip_possessive(&t.lower);
            // "No, it doesn't ..." / "Yes, ...": an answer word, not a negation.
            let interjection = t.sentence_start
                && matches!(t.lower.as_str(), "no" | "nope")
                && tokens.get(i + 1).is_none_or(|n| n.clause_start);
            if is_negation(&t.lower) && !interjection {
                f.negations += 1;
            }
            if let Some(n) = number_token(&t.lower) {
                // "7 pm" → "7pm".
                let suffix = tokens
                    .get(i + 1)
                    .map(|n| n.lower.as_str())
                    .filter(|s| matches!(*s, "am" | "pm"));
                match suffix {
                    Some(s) => {
                        f.numbers.push(format!("{n}{s}"));
                        i += 1;
                    }
                    None => f.numbers.push(n),
                }
            } else if let Some((value, used)) = number_words(&tokens[i..]) {
                if used == 1 && t.lower == "one" {
                    f.ones_from_word += 1;
                }
                f.numbers.push(value);
                i += used;
                continue;
            }
            // "Morning! How do I ..." is a greeting, not a time.
            let greeting = t.sentence_start && tokens.get(i + 1).is_none_or(|n| n.clause_start);
            if let Some(d) = date_word(w, t, caseless).filter(|_| !greeting) {
                f.dates.push(d);
            }
            if t.cased && !t.sentence_start && !caseless && !NOT_ENTITIES.contains(&w) {
                f.entities.push(w.to_string());
            }
            // Phrasal verbs whose particle flips the meaning: "opt in" / "opt out".
            let next = tokens.get(i + 1).map(|n| n.lower.as_str());
            if let Some(p) = next.filter(|p| PARTICLES.contains(p)) {
                if PHRASAL_VERBS.contains(&w) {
                    words.push(format!("{w}_{p}"));
                    i += 2;
                    continue;
                }
            }
            words.push(w.to_string());
            i += 1;
        }
        f.words = words;
        f.tokens = tokens;
        f
    }
}

/// Splits into words. Apostrophes inside words are kept ("don't", "mary's"); '.', ',' and
/// ':' are kept between digits ("9:15", "2,700", "1.5"); everything else separates.
pub(super) fn tokenize(text: &str) -> Vec<Token> {
    super::steps(text.len());
    let chars: Vec<char> = text
        .chars()
        .map(|c| match c {
            '\u{2019}' | '\u{2018}' | '`' => '\'',
            c => c,
        })
        .collect();
    let mut out = Vec::new();
    let mut current = String::new();
    let mut cased = false;
    let mut sentence_start = true;
    let mut clause_start = true;
    let mut pending_sentence = true;
    let mut pending_clause = true;
    let flush = |current: &mut String,
                 cased: &mut bool,
                 out: &mut Vec<Token>,
                 sentence: &mut bool,
                 clause: &mut bool| {
        if !current.is_empty() {
            out.push(Token {
                lower: current.to_lowercase(),
                cased: *cased,
                sentence_start: *sentence,
                clause_start: *clause,
            });
            current.clear();
            *sentence = false;
            *clause = false;
        }
        *cased = false;
    };
    for (i, &c) in chars.iter().enumerate() {
        let prev = i.checked_sub(1).map(|j| chars[j]);
        let next = chars.get(i + 1).copied();
        let keep = c.is_alphanumeric()
            || (c == '\'' && !current.is_empty() && next.is_some_and(char::is_alphabetic))
            || (matches!(c, '.' | ',' | ':')
                && prev.is_some_and(|p| p.is_ascii_digit())
                && next.is_some_and(|n| n.is_ascii_digit())
                && !current.is_empty());
        if keep {
            if current.is_empty() {
                sentence_start = pending_sentence;
                clause_start = pending_clause;
                pending_sentence = false;
                pending_clause = false;
            }
            if c.is_uppercase() {
                cased = true;
            }
            current.push(c);
            continue;
        }
        flush(
            &mut current,
            &mut cased,
            &mut out,
            &mut sentence_start,
            &mut clause_start,
        );
        if matches!(c, '.' | '!' | '?' | ':' | ';' | '"' | '(' | '\u{201c}') {
            pending_sentence = true;
        }
        if !c.is_whitespace() && c != '-' && c != '\'' && c != '/' {
            pending_clause = true;
        }
    }
    flush(
        &mut current,
        &mut cased,
        &mut out,
        &mut sentence_start,
        &mut clause_start,
    );
    out
}

/// Strings between double quotes, curly quotes or backticks, trimmed and lower-cased.
fn quoted(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut open: Option<(char, usize)> = None;
    for (i, c) in text.char_indices() {
        match (open, c) {
            (None, '"' | '\u{201c}' | '`') => open = Some((c, i + c.len_utf8())),
            (Some((o, start)), _)
                if (o == '"' && c == '"')
                    || (o == '\u{201c}' && c == '\u{201d}')
                    || (o == '`' && c == '`') =>
            {
                out.push(text[start..i].trim().to_lowercase());
                open = None;
            }
            _ => {}
        }
    }
    out.sort();
    out
}

/// A numeric token, normalised: "£50" is tokenised as "50"; "2,700" → "2700";
/// "3rd" → "3rd"; "7pm" → "7pm"; "10gb" → "10" (units are not numbers).
fn number_token(w: &str) -> Option<String> {
    let first = w.chars().next()?;
    if !first.is_ascii_digit() {
        return None;
    }
    let digits_end = w
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | ',' | ':')))
        .unwrap_or(w.len());
    let (num, rest) = w.split_at(digits_end);
    let num: String = num.chars().filter(|&c| c != ',').collect();
    let num = num.trim_end_matches(['.', ':']).to_string();
    Some(match rest {
        "am" | "pm" => format!("{num}{rest}"),
        "st" | "nd" | "rd" | "th" => format!("{num}th"),
        _ => num,
    })
}

/// Number words starting at `tokens[0]`: the value (as digits) and how many tokens it used.
/// "twenty five" → 25, "one hundred" → 100, "fifteen" → 15, "third" → "3th".
fn number_words(tokens: &[Token]) -> Option<(String, usize)> {
    if let Some(n) = ordinal_word(&tokens[0].lower) {
        return Some((format!("{n}th"), 1));
    }
    let mut total: u64 = 0;
    let mut current: u64 = 0;
    let mut used = 0;
    for t in tokens {
        let w = t.lower.as_str();
        if let Some(v) = unit_word(w) {
            // "twenty five": units after tens; a second unit in a row starts a new number.
            if used > 0 && (!current.is_multiple_of(10) || current == 0) {
                break;
            }
            current = current.saturating_add(v);
        } else if w == "hundred" && used > 0 {
            // Saturating: the words come from the client ("hundred hundred ...").
            current = current.max(1).saturating_mul(100);
        } else if let Some(m) = scale_word(w).filter(|_| used > 0) {
            total = total.saturating_add(current.max(1).saturating_mul(m));
            current = 0;
        } else {
            break;
        }
        used += 1;
    }
    (used > 0).then(|| (total.saturating_add(current).to_string(), used))
}

/// Weekdays, months, relative days. "may" and "march" count only when capitalised mid-
/// sentence (they are also a verb); plurals fold ("sundays").
fn date_word(w: &str, t: &Token, caseless: bool) -> Option<&'static str> {
    let singular = w.strip_suffix('s').unwrap_or(w);
    if let Some(d) = DATES.iter().find(|d| **d == w || **d == singular) {
        return Some(d);
    }
    match w {
        "may" if t.cased && !t.sentence_start && !caseless => Some("may"),
        "march" if t.cased && !t.sentence_start && !caseless => Some("march"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::sorted;

    #[test]
    fn number_parsing() {
        let f =
            Features::of("Could I get a table for two at seven this evening, 2,700 kWh, £50, 3rd");
        assert_eq!(sorted(&f.numbers), vec!["2", "2700", "3th", "50", "7"]);
        let f = Features::of("twenty five or one hundred");
        assert_eq!(sorted(&f.numbers), vec!["100", "25"]);
        // Number words past what a u64 holds saturate instead of overflowing.
        let huge = format!("one{} billion", " hundred".repeat(12));
        assert_eq!(Features::of(&huge).numbers, [u64::MAX.to_string()]);
    }

    #[test]
    fn tokens_mark_sentence_and_clause_starts() {
        let t = tokenize("Hi, don\u{2019}t stop. Call Paris at 9:15!");
        let words: Vec<&str> = t.iter().map(|t| t.lower.as_str()).collect();
        assert_eq!(
            words,
            ["hi", "don't", "stop", "call", "paris", "at", "9:15"]
        );
        let starts: Vec<(bool, bool)> = t
            .iter()
            .map(|t| (t.sentence_start, t.clause_start))
            .collect();
        assert_eq!(
            starts,
            [
                (true, true),
                (false, true),
                (false, false),
                (true, true),
                (false, false),
                (false, false),
                (false, false),
            ]
        );
        assert!(t[4].cased && !t[5].cased);
    }

    #[test]
    fn quotes_entities_and_dates() {
        // A quote opens a sentence, so its first word is not an entity.
        let f = Features::of("What does \"Disk Full\" mean on my Mac in March?");
        assert_eq!(f.quotes, ["disk full"]);
        assert_eq!(f.entities, ["full", "mac", "march"]);
        assert_eq!(f.dates, ["march"]);
        // All caps carries no case information: no entities, and "MARCH" is not a month.
        let f = Features::of("WHAT DOES MY MAC DO IN MARCH");
        assert!(f.entities.is_empty() && f.dates.is_empty());
    }
}
