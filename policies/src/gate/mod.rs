//! The false-hit gate: a cheap textual check run on a semantic candidate before it is served.
//!
//! Embedding similarity is blind to the small edits that change an answer: a negation
//! ("can I" / "can't I"), a swapped name or place, a changed number or date, a reversed
//! direction ("from A to B" / "from B to A"), an antonym (enable / disable). Those pairs
//! score 0.9 and above. [`gate`] compares the two prompts' surface features and rejects the
//! pair when one of them differs; a rejected candidate is a miss, never a wrong answer.
//!
//! The rules, each one a [`GateVerdict::Reject`] reason:
//! - `number`: the multisets of numbers (digits with their sign and magnitude, number words,
//!   times, ordinals, digits inside words such as "python3", roman numerals in capitals
//!   such as "XLIX") differ.
//! - `operator`: both sides put operators between numbers (`+`, `-`, `*`, `/`, `^`,
//!   comparisons, or "plus", "minus", "times", "divided") and not the same ones.
//! - `currency`: both sides name currencies (by symbol, word or code) and not the same ones.
//! - `date`: the multisets of weekday, month and relative-day words differ.
//! - `negation`: the parity of negations (not, n't, no, never, without, non-..., and words
//!   that leave out what follows: except, excluding, other than) differs.
//! - `antonym`: one side has a word, the other its opposite (and not the word itself),
//!   from a fixed list or by an un-/dis-/de- prefix; or a word under opposite prefixes
//!   ("pre-tax" / "post-tax", "pro-" / "anti-") or under "self-" or "ex-" on one side only
//!   ("self-employed" / "employed", "ex-partner" / "partner").
//! - `entity`: a capitalised word (not at the start of a sentence) or a quoted string on one
//!   side is missing from the other.
//! - `direction`: words before "to" on one side come after it on the other, and vice versa.
//! - `order`: two spans exchanged around the same connective, the rest word for word equal
//!   ("Is Python faster than Java?" / "Is Java faster than Python?"; see `order`).
//! - `scope`: both sides fill a closed class (quantifier, period, people, position,
//!   statistic, format, length, register, price) with different values ("adults" /
//!   "children", "per month" / "per year", "all" / "any"; see `scope`).
//!
//! Its cost is linear in the text it reads (word sets and single passes, no rescans), and it
//! reads at most [`MAX_TEXT_BYTES`] of each prompt: a few dozen tokens take microseconds, and
//! a prompt of megabytes costs no more than its first 32 KiB. A difference beyond the cap is
//! not seen: the server passes only what the embedder reads of each prompt (at most 16 KiB),
//! since two prompts in one semantic partition are equal beyond that.
//!
//! This module holds the verdict and the rules that compare two prompts; `features`
//! extracts what the rules compare, `lexicon` holds the word lists and single-word
//! lookups, and `substitution` finds the words two near-identical prompts swap, for a
//! check the caller makes with the embedder.

mod features;
mod lexicon;
mod order;
mod scope;
mod substitution;

pub use self::substitution::substitution;

use std::collections::{HashMap, HashSet};

use self::features::Features;
use self::lexicon::{antonym_bases, singular, strip_possessive, ANTONYMS, STOPWORDS};

/// The most bytes of each prompt the gate reads; the rest is not looked at.
pub const MAX_TEXT_BYTES: usize = 32 * 1024;

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

/// Checks whether a cached answer to `candidate` may be served for `query`, reading at most
/// [`MAX_TEXT_BYTES`] of each.
///
/// Symmetric: `gate(a, b) == gate(b, a)`.
pub fn gate(query: &str, candidate: &str) -> GateVerdict {
    judge(capped(query), capped(candidate))
}

/// The start of `text` the gate reads: at most [`MAX_TEXT_BYTES`], ending before the last
/// whitespace there (a word cut in two would read as another word). A caller that copies a
/// prompt for the gate needs to copy no more.
pub fn capped(text: &str) -> &str {
    if text.len() <= MAX_TEXT_BYTES {
        return text;
    }
    let end = text.floor_char_boundary(MAX_TEXT_BYTES);
    let end = text[..end].rfind(char::is_whitespace).unwrap_or(end);
    &text[..end]
}

/// The rules over the whole of both texts.
fn judge(query: &str, candidate: &str) -> GateVerdict {
    let a = Features::of(query);
    let b = Features::of(candidate);
    let (wa, wb) = (Words::of(&a), Words::of(&b));
    if !same_numbers(&a, &b, &wa, &wb) {
        return GateVerdict::Reject("number");
    }
    if both_differ(&sorted(&a.operators), &sorted(&b.operators)) {
        return GateVerdict::Reject("operator");
    }
    if both_differ(&distinct(&a.currencies), &distinct(&b.currencies)) {
        return GateVerdict::Reject("currency");
    }
    if sorted(&a.dates) != sorted(&b.dates) {
        return GateVerdict::Reject("date");
    }
    if a.negations % 2 != b.negations % 2 {
        return GateVerdict::Reject("negation");
    }
    if antonyms(&wa, &wb) || prefixed_once(&wa, &wb) || prefixed_once(&wb, &wa) {
        return GateVerdict::Reject("antonym");
    }
    if !entities_covered(&a, &wb) || !entities_covered(&b, &wa) || !same_quotes(&a, &b) {
        return GateVerdict::Reject("entity");
    }
    if reversed(&a, &b) {
        return GateVerdict::Reject("direction");
    }
    if let (Some(x), Some(y)) = (order::folded(&a.tokens), order::folded(&b.tokens)) {
        if order::swapped(&x, &y) {
            return GateVerdict::Reject("order");
        }
    }
    let short = a.tokens.len() <= scope::MAX_TOKENS && b.tokens.len() <= scope::MAX_TOKENS;
    if short && scope::differs(&scope::values(&a.words), &scope::values(&b.words)).is_some() {
        return GateVerdict::Reject("scope");
    }
    GateVerdict::Pass
}

// Work done by the gate on this thread, counted in steps of constant cost (a character, a
// word, a set lookup), for the tests that show its cost is linear.
#[cfg(test)]
thread_local! {
    static STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts `n` steps of work (tests only).
#[inline(always)]
pub(crate) fn steps(n: usize) {
    #[cfg(test)]
    STEPS.with(|s| s.set(s.get() + n as u64));
    #[cfg(not(test))]
    let _ = n;
}

/// The sets the word rules look words up in, built once per prompt in one pass each.
struct Words<'a> {
    /// The words (possessives stripped, phrasal verbs joined).
    words: HashSet<&'a str>,
    /// The words of [`ANTONYMS`] this prompt has, itself or inflected.
    antonyms: HashSet<&'static str>,
    /// Every token, lower-cased, possessive stripped and plural folded (for entities).
    folded: HashSet<&'a str>,
    /// Words under a modifying prefix ("self-employed").
    compounds: HashSet<&'a str>,
}

impl<'a> Words<'a> {
    fn of(f: &'a Features) -> Self {
        steps(f.words.len() + f.tokens.len());
        Words {
            words: f.words.iter().map(String::as_str).collect(),
            antonyms: f.words.iter().flat_map(|w| antonym_bases(w)).collect(),
            folded: f
                .tokens
                .iter()
                .map(|t| singular(strip_possessive(&t.lower)))
                .collect(),
            compounds: f.compounds.iter().map(String::as_str).collect(),
        }
    }
}

/// Both sides name some (operators, currencies), and not the same: a side that names none
/// may have written them otherwise ("add 4 to 12"), so it decides nothing.
fn both_differ(a: &[&str], b: &[&str]) -> bool {
    !a.is_empty() && !b.is_empty() && a != b
}

/// The distinct values, sorted.
fn distinct<'s>(v: &[&'s str]) -> Vec<&'s str> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// A sorted copy, for comparing multisets.
fn sorted<T: Ord + Clone>(v: &[T]) -> Vec<T> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// Same numbers on both sides, up to one unmatched "one" spelled as a word.
fn same_numbers(a: &Features, b: &Features, wa: &Words, wb: &Words) -> bool {
    let mut x = sorted(&a.numbers);
    let mut y = sorted(&b.numbers);
    if x == y {
        return true;
    }
    // A roman numeral the other side has as a plain word (lower case, a shouted text) is
    // the same numeral: "World War II" / "world war ii".
    let as_word = |v: &mut Vec<String>, f: &Features, other: &Words, other_f: &Features| {
        steps(f.romans.len() + other_f.romans.len() + v.len());
        let read_there: HashSet<&str> = other_f.romans.iter().map(|(_, t)| t.as_str()).collect();
        let mut unread: HashMap<&str, usize> = HashMap::new();
        for (value, text) in &f.romans {
            if other.words.contains(text.as_str()) && !read_there.contains(text.as_str()) {
                *unread.entry(value.as_str()).or_default() += 1;
            }
        }
        v.retain(|n| match unread.get_mut(n.as_str()) {
            Some(k) if *k > 0 => {
                *k -= 1;
                false
            }
            _ => true,
        });
    };
    as_word(&mut x, a, wb, b);
    as_word(&mut y, b, wa, a);
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

/// One side has a word and the other its opposite, from [`ANTONYMS`] or by a prefix.
fn antonyms(a: &Words, b: &Words) -> bool {
    steps(ANTONYMS.len());
    for (x, y) in ANTONYMS {
        let (ax, ay, bx, by) = (
            a.antonyms.contains(x),
            a.antonyms.contains(y),
            b.antonyms.contains(x),
            b.antonyms.contains(y),
        );
        if (ax && !ay && by && !bx) || (ay && !ax && bx && !by) {
            return true;
        }
    }
    prefixed_opposite(a, b) || prefixed_opposite(b, a)
}

/// "unlock" against "lock", "disconnect" against "connect", "deactivate" against
/// "activate": one side has the prefixed word, the other the bare one and not the prefixed.
fn prefixed_opposite(a: &Words, b: &Words) -> bool {
    steps(a.words.len());
    for w in &a.words {
        for prefix in ["un", "dis", "de"] {
            let Some(bare) = w.strip_prefix(prefix) else {
                continue;
            };
            // Short remainders are usually not words of their own ("under", "desk").
            if bare.len() < 4 {
                continue;
            }
            if b.words.contains(bare) && !b.words.contains(w) && !a.words.contains(bare) {
                return true;
            }
        }
    }
    false
}

/// `a` puts a prefix on a word that `b` has under the opposite prefix ("pre-tax" /
/// "post-tax", "pro-choice" / "anti-choice"), or `a` has "self-" or "ex-" on a word that `b`
/// has bare ("self-employed" / "employed", "ex-partner" / "partner"; see
/// `features::compound`). `b` keeps a "self-" or "ex-" when it has the compound, the prefix
/// as a word ("self employed"), or words that say it otherwise ("self-hosted" / "hosted on
/// my own server", "ex-wife" / "former wife").
fn prefixed_once(a: &Words, b: &Words) -> bool {
    const OPPOSITE: &[(&str, &str)] = &[("pre", "post"), ("pro", "anti"), ("inter", "intra")];
    const SAID_OF_SELF: &[&str] = &[
        "own",
        "myself",
        "yourself",
        "himself",
        "herself",
        "itself",
        "ourselves",
        "yourselves",
        "themselves",
        "oneself",
    ];
    const SAID_OF_EX: &[&str] = &["former", "previous", "old"];
    steps(a.compounds.len() * (2 + SAID_OF_SELF.len()));
    a.compounds.iter().any(|c| {
        let Some((prefix, word)) = c.split_once('-') else {
            return false;
        };
        let opposite = OPPOSITE.iter().find_map(|&(x, y)| match prefix {
            p if p == x => Some(y),
            p if p == y => Some(x),
            _ => None,
        });
        if let Some(o) = opposite {
            return b.compounds.contains(format!("{o}-{word}").as_str())
                && !b.compounds.contains(c);
        }
        let said = match prefix {
            "self" => SAID_OF_SELF,
            "ex" => SAID_OF_EX,
            _ => return false,
        };
        let kept = b.compounds.contains(c)
            || b.words.contains(prefix)
            || said.iter().any(|w| b.words.contains(w));
        b.words.contains(word) && !kept
    })
}

/// Every entity of `a` appears as a word of `b` (case-insensitively, plurals folded).
fn entities_covered(a: &Features, b: &Words) -> bool {
    steps(a.entities.len());
    a.entities.iter().all(|e| b.folded.contains(singular(e)))
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
mod tests;
