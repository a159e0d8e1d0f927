//! The false-hit gate: a cheap textual check run on a semantic candidate before it is served.
//!
//! Embedding similarity is blind to the small edits that change an answer: a negation
//! ("can I" / "can't I"), a swapped name or place, a changed number or date, a reversed
//! direction ("from A to B" / "from B to A"), an antonym (enable / disable). Those pairs
//! score 0.9 and above. [`gate`] compares the two prompts' surface features and rejects the
//! pair when one of them differs; a rejected candidate is a miss, never a wrong answer.
//!
//! The rules, each one a [`GateVerdict::Reject`] reason:
//! - `number`: the multisets of numbers (digits, number words, times, ordinals) differ.
//! - `date`: the multisets of weekday, month and relative-day words differ.
//! - `negation`: the parity of negations (not, n't, no, never, without, non-...) differs.
//! - `antonym`: one side has a word, the other its opposite (and not the word itself),
//!   from a fixed list or by an un-/dis-/de- prefix.
//! - `entity`: a capitalised word (not at the start of a sentence) or a quoted string on one
//!   side is missing from the other.
//! - `direction`: words before "to" on one side come after it on the other, and vice versa.
//!
//! Everything is allocation-light string work over a few dozen tokens: microseconds.
//!
//! This module holds the verdict and the rules that compare two prompts; `features`
//! extracts what the rules compare, `lexicon` holds the word lists and single-word
//! lookups, and `substitution` finds the words two near-identical prompts swap, for a
//! check the caller makes with the embedder.

mod features;
mod lexicon;
mod substitution;

pub use self::substitution::substitution;

use self::features::Features;
use self::lexicon::{inflects, singular, strip_possessive, ANTONYMS, STOPWORDS};

/// The gate's decision on a (query, cached prompt) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateVerdict {
    /// Nothing suggests the answers differ.
    Pass,
    /// The answers likely differ; the reason is a short fixed label (for metrics and logs).
    Reject(&'static str),
}

impl GateVerdict {
    /// True for [`GateVerdict::Pass`].
    pub fn is_pass(&self) -> bool {
        matches!(self, GateVerdict::Pass)
    }

    /// The rejection reason, if any.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            GateVerdict::Pass => None,
            GateVerdict::Reject(r) => Some(r),
        }
    }
}

/// Checks whether a cached answer to `candidate` may be served for `query`.
///
/// Symmetric: `gate(a, b) == gate(b, a)`.
pub fn gate(query: &str, candidate: &str) -> GateVerdict {
    let a = Features::of(query);
    let b = Features::of(candidate);
    if !same_numbers(&a, &b) {
        return GateVerdict::Reject("number");
    }
    if sorted(&a.dates) != sorted(&b.dates) {
        return GateVerdict::Reject("date");
    }
    if a.negations % 2 != b.negations % 2 {
        return GateVerdict::Reject("negation");
    }
    if antonyms(&a, &b) {
        return GateVerdict::Reject("antonym");
    }
    if !entities_covered(&a, &b) || !entities_covered(&b, &a) || !same_quotes(&a, &b) {
        return GateVerdict::Reject("entity");
    }
    if reversed(&a, &b) {
        return GateVerdict::Reject("direction");
    }
    GateVerdict::Pass
}

/// A sorted copy, for comparing multisets.
fn sorted<T: Ord + Clone>(v: &[T]) -> Vec<T> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// Same numbers on both sides, up to one unmatched "one" spelled as a word.
fn same_numbers(a: &Features, b: &Features) -> bool {
    let mut x = sorted(&a.numbers);
    let mut y = sorted(&b.numbers);
    if x == y {
        return true;
    }
    // "quick one" / "which one": a lone unmatched "one" from a word is tolerated.
    let remove_one = |v: &mut Vec<String>, from_word: usize, other: &[String]| {
        if from_word > 0 {
            let ones_here = v.iter().filter(|n| *n == "1").count();
            let ones_there = other.iter().filter(|n| *n == "1").count();
            if ones_here > ones_there {
                if let Some(p) = v.iter().position(|n| n == "1") {
                    v.remove(p);
                }
            }
        }
    };
    let y0 = y.clone();
    remove_one(&mut x, a.ones_from_word, &y0);
    let x0 = x.clone();
    remove_one(&mut y, b.ones_from_word, &x0);
    x == y
}

/// Same quoted strings on both sides.
fn same_quotes(a: &Features, b: &Features) -> bool {
    a.quotes == b.quotes
}

/// Whether any of `words` is `base` or an inflection of it.
fn has(words: &[String], base: &str) -> bool {
    words.iter().any(|w| inflects(w, base))
}

/// One side has a word and the other its opposite, from [`ANTONYMS`] or by a prefix.
fn antonyms(a: &Features, b: &Features) -> bool {
    for (x, y) in ANTONYMS {
        let (ax, ay, bx, by) = (
            has(&a.words, x),
            has(&a.words, y),
            has(&b.words, x),
            has(&b.words, y),
        );
        if (ax && !ay && by && !bx) || (ay && !ax && bx && !by) {
            return true;
        }
    }
    prefixed_opposite(a, b) || prefixed_opposite(b, a)
}

/// "unlock" against "lock", "disconnect" against "connect", "deactivate" against
/// "activate": one side has the prefixed word, the other the bare one and not the prefixed.
fn prefixed_opposite(a: &Features, b: &Features) -> bool {
    for w in &a.words {
        for prefix in ["un", "dis", "de"] {
            let Some(bare) = w.strip_prefix(prefix) else {
                continue;
            };
            // Short remainders are usually not words of their own ("under", "desk").
            if bare.len() < 4 {
                continue;
            }
            let b_has_bare = b.words.iter().any(|v| v == bare);
            let b_has_prefixed = b.words.iter().any(|v| v == w);
            let a_has_bare = a.words.iter().any(|v| v == bare);
            if b_has_bare && !b_has_prefixed && !a_has_bare {
                return true;
            }
        }
    }
    false
}

/// Every entity of `a` appears as a word of `b` (case-insensitively, plurals folded).
fn entities_covered(a: &Features, b: &Features) -> bool {
    a.entities.iter().all(|e| {
        let e = singular(e);
        b.tokens
            .iter()
            .any(|t| singular(strip_possessive(&t.lower)) == e)
    })
}

/// The content words before and after each "to" in a clause (up to 3 each side).
fn around_to(f: &Features) -> Vec<(Vec<&str>, Vec<&str>)> {
    let t = &f.tokens;
    let is_to = |w: &str| matches!(w, "to" | "into" | "onto" | "towards");
    let mut out = Vec::new();
    for (p, tok) in t.iter().enumerate() {
        if !is_to(&tok.lower) {
            continue;
        }
        let mut left = Vec::new();
        let mut j = p;
        while j > 0 && left.len() < 3 && !t[j].clause_start {
            j -= 1;
            let w = strip_possessive(&t[j].lower);
            if is_to(w) {
                break;
            }
            if !STOPWORDS.contains(&w) {
                left.push(w);
            }
        }
        let mut right = Vec::new();
        for cur in &t[p + 1..] {
            if cur.clause_start || right.len() >= 3 {
                break;
            }
            let w = strip_possessive(&cur.lower);
            if is_to(w) || w == "from" {
                break;
            }
            if !STOPWORDS.contains(&w) {
                right.push(w);
            }
        }
        out.push((left, right));
    }
    out
}

/// "from A to B" against "from B to A", "Word to PDF" against "PDF to Word".
fn reversed(a: &Features, b: &Features) -> bool {
    // In long passages the windows of unrelated "to"s cross by chance; prompts that differ
    // only by direction are short.
    if a.tokens.len() > 40 || b.tokens.len() > 40 {
        return false;
    }
    let (sa, sb) = (around_to(a), around_to(b));
    let meets = |x: &[&str], y: &[&str]| x.iter().any(|w| y.contains(w));
    sa.iter().any(|(la, ra)| {
        sb.iter()
            .any(|(lb, rb)| meets(la, rb) && meets(ra, lb) && !(meets(la, lb) && meets(ra, rb)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejects(a: &str, b: &str, reason: &str) {
        assert_eq!(
            gate(a, b),
            GateVerdict::Reject(static_reason(reason)),
            "{a} | {b}"
        );
        assert_eq!(
            gate(b, a),
            GateVerdict::Reject(static_reason(reason)),
            "{b} | {a}"
        );
    }

    fn static_reason(r: &str) -> &'static str {
        [
            "number",
            "date",
            "negation",
            "antonym",
            "entity",
            "direction",
        ]
        .into_iter()
        .find(|x| *x == r)
        .expect("known reason")
    }

    fn passes(a: &str, b: &str) {
        assert_eq!(gate(a, b), GateVerdict::Pass, "{a} | {b}");
        assert_eq!(gate(b, a), GateVerdict::Pass, "{b} | {a}");
    }

    #[test]
    fn paraphrases_pass() {
        passes(
            "How do I reset my password?",
            "I forgot my password, how can I change it?",
        );
        passes(
            "How do I order a new debit card?",
            "How can I order a new debit card?",
        );
        passes(
            "What are your delivery options to Northern Ireland?",
            "WHAT ARE YOUR DELIVERY OPTIONS TO NORTHERN IRELAND?",
        );
        passes("Do you accept Apple Pay?", "Do You Accept Apple Pay?");
        passes(
            "How do I order a replacement debit card?",
            "Hi, quick one: how do I order a replacement debit card?",
        );
        passes(
            "What's the capital of Australia?",
            "Which city is Australia's capital?",
        );
        passes(
            "Transfer £50 from my savings to my current account",
            "Move fifty pounds from savings into my current account",
        );
        passes(
            "How many days of annual leave do I get after 5 years?",
            "What's my holiday entitlement once I've been here five years?",
        );
        passes(
            "What is the tallest mountain in the UK?",
            "um what is the tallest mountain in the uk",
        );
        passes("How do I unlock my card?", "How do I unfreeze my card?");
    }

    #[test]
    fn verdict_helpers() {
        assert!(GateVerdict::Pass.is_pass());
        assert_eq!(GateVerdict::Pass.reason(), None);
        assert!(!GateVerdict::Reject("number").is_pass());
        assert_eq!(GateVerdict::Reject("number").reason(), Some("number"));
    }

    #[test]
    fn negation_is_caught() {
        rejects(
            "Can I claim this back?",
            "Can't I claim this back?",
            "negation",
        );
        rejects(
            "Cancel my subscription",
            "Don't cancel my subscription",
            "negation",
        );
        rejects(
            "Which plans include international calls?",
            "Which plans do not include international calls?",
            "negation",
        );
        rejects(
            "Is the deposit refundable?",
            "Is the deposit non-refundable?",
            "negation",
        );
        rejects(
            "Do I need a prescription for this medicine?",
            "Can I get this medicine without a prescription?",
            "negation",
        );
    }

    #[test]
    fn antonyms_are_caught() {
        rejects(
            "How do I enable dark mode?",
            "How do I disable dark mode?",
            "antonym",
        );
        rejects(
            "How do I install Docker",
            "How do I uninstall Docker",
            "antonym",
        );
        rejects(
            "How do I increase the font size?",
            "How do I decrease the font size?",
            "antonym",
        );
        rejects(
            "What's the minimum deposit?",
            "What's the maximum deposit?",
            "antonym",
        );
        rejects(
            "How do I upload a file?",
            "How do I download a file?",
            "antonym",
        );
        rejects(
            "How do I opt in to the workplace pension?",
            "How do I opt out of the workplace pension?",
            "antonym",
        );
        rejects(
            "How do I lock my card?",
            "How do I unlock my card?",
            "antonym",
        );
        rejects(
            "What should I do before the interview?",
            "What should I do after the interview?",
            "antonym",
        );
        rejects(
            "Is it cheaper to buy shares?",
            "Is it cheaper to sell shares?",
            "antonym",
        );
    }

    #[test]
    fn numbers_are_caught() {
        rejects(
            "Who won the World Cup in 2014?",
            "Who won the World Cup in 2018?",
            "number",
        );
        rejects(
            "Convert 100 USD to GBP",
            "Convert 1000 USD to GBP",
            "number",
        );
        rejects("Remind me at 7am", "Remind me at 7pm", "number");
        rejects(
            "How many calories are in one egg?",
            "How many calories are in three eggs?",
            "number",
        );
        rejects(
            "Is the 9:15 train on time?",
            "Is the 9:45 train on time?",
            "number",
        );
        rejects("Track order 48213", "Track order 48231", "number");
    }

    #[test]
    fn dates_are_caught() {
        rejects(
            "Are you open on Saturday?",
            "Are you open on Sunday?",
            "date",
        );
        rejects(
            "What time does the pharmacy close on weekdays?",
            "What time does the pharmacy close on weekends?",
            "date",
        );
        rejects(
            "What was my bill in January?",
            "What was my bill in June?",
            "date",
        );
    }

    #[test]
    fn swapped_entities_are_caught() {
        rejects(
            "Who is the CEO of Microsoft?",
            "Who is the CEO of Apple?",
            "entity",
        );
        rejects(
            "What's the weather in Paris tomorrow?",
            "What's the weather in Rome tomorrow?",
            "entity",
        );
        rejects(
            "How do I install Python on Windows?",
            "How do I install Python on macOS?",
            "entity",
        );
        rejects(
            "What's Mary's phone number?",
            "What's Mark's phone number?",
            "entity",
        );
        rejects(
            "What does the error \"disk full\" mean?",
            "What does the error \"disk missing\" mean?",
            "entity",
        );
    }

    #[test]
    fn reversed_direction_is_caught() {
        rejects(
            "How do I migrate my database from MySQL to Postgres?",
            "How do I migrate my database from Postgres to MySQL?",
            "direction",
        );
        rejects(
            "How do I convert a Word document to PDF?",
            "How do I convert a PDF to a Word document?",
            "direction",
        );
        rejects(
            "How do I transfer money from my savings to my current account?",
            "How do I transfer money from my current account to my savings?",
            "direction",
        );
        rejects(
            "translate english to french",
            "translate french to english",
            "direction",
        );
    }
}
