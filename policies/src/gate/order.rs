//! The `order` rule: the two arguments of a relation swapped, whatever the connective.
//!
//! "Is Python faster than Java?" / "Is Java faster than Python?", "What is 144 divided by
//! 12?" / "What is 12 divided by 144?", "my mother's father" / "my father's mother", "Did
//! Germany beat Brazil?" / "Did Brazil beat Germany?": the same words, two spans exchanged
//! around the same connective. Embeddings score such pairs near 1.0, and no list of
//! connectives ("from … to") covers them all, so the rule looks at the shape instead: after
//! folding what does not change meaning (case, which article, plurals, auxiliaries'
//! person), the two prompts are `P X M Y S` and `P Y M X S` with `X ≠ Y` — the rest word
//! for word equal. Articles stay as a placeholder word, so "Is a square a rectangle?" swaps
//! around "a" while "What is the best degree?" / "What degree is best?" has a word more on
//! one side and is no swap.
//!
//! What it leaves alone, since those reorders keep the meaning:
//! - a phrase moved as a unit: "In Python, how do I sort a list?" / "How do I sort a list in
//!   Python?" is a rotation (`X Y` / `Y X`, nothing between), not a swap;
//! - coordination: "cats and dogs" / "dogs and cats", "tabs or spaces" (`M` is only "and",
//!   "or" or "&");
//! - two neighbours trading places with nothing between them ("the best C# books" / "the C#
//!   best books", "quickly learn" / "learn quickly"), unless both are names or numbers
//!   ("EUR/USD" / "USD/EUR").
//!
//! Bounded: prompts of more than [`MAX_TOKENS`] words are not checked (a swap is a short
//! prompt's edit; in long passages the rest would never be word for word equal), so the
//! work per pair is constant.

use super::features::Token;
use super::lexicon::{singular, STOPWORDS};

/// The longest prompt, in words, the rule looks at.
pub(super) const MAX_TOKENS: usize = 48;

/// Connectives whose two sides can be exchanged freely.
const SYMMETRIC: &[&[&str]] = &[&["and"], &["or"], &["&"], &["and", "or"], &["nor"]];

/// One prompt folded for the comparison: lower case, articles as one placeholder, plurals
/// folded, auxiliaries to one person, possessive `'s` as a word of its own; each word with
/// whether it is a name or a number (cased, or starting with a digit).
pub(super) fn folded(tokens: &[Token]) -> Option<Vec<(String, bool)>> {
    if tokens.len() > MAX_TOKENS {
        return None;
    }
    let mut out = Vec::with_capacity(tokens.len() + 4);
    for t in tokens {
        let w = t.lower.as_str();
        let (w, possessive) = match w.strip_suffix("'s") {
            Some(stem)
                if !matches!(
                    w,
                    "it's" | "what's" | "that's" | "there's" | "he's" | "she's" | "let's"
                ) =>
            {
                (stem, true)
            }
            _ => (w.strip_suffix('\'').unwrap_or(w), false),
        };
        let marked = t.cased || w.starts_with(|c: char| c.is_ascii_digit());
        let w = match w {
            "a" | "an" | "the" => "a",
            "does" | "did" => "do",
            "is" | "are" | "was" | "were" | "am" => "be",
            "has" | "had" => "have",
            // A name keeps its letters: "HTTPS" is not the plural of "HTTP".
            w if marked => w,
            w => singular(w),
        };
        out.push((w.to_string(), marked));
        if possessive {
            out.push(("'s".to_string(), false));
        }
    }
    Some(out)
}

/// Whether `b` is `a` with two spans exchanged around an unchanged middle (see the module).
pub(super) fn swapped(a: &[(String, bool)], b: &[(String, bool)]) -> bool {
    let marked = |w: &str| a.iter().chain(b).any(|(x, m)| *m && x == w);
    let a: Vec<String> = a.iter().map(|(w, _)| w.clone()).collect();
    let b: Vec<String> = b.iter().map(|(w, _)| w.clone()).collect();
    if a.len() != b.len() || a == b {
        return false;
    }
    // A swap keeps the multiset of words.
    let mut x: Vec<&String> = a.iter().collect();
    let mut y: Vec<&String> = b.iter().collect();
    x.sort();
    y.sort();
    if x != y {
        return false;
    }
    let n = a.len();
    let p = a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count();
    let s = a[p..]
        .iter()
        .rev()
        .zip(b[p..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (ar, br) = (&a[p..n - s], &b[p..n - s]);
    super::steps(ar.len() * ar.len());
    let len = ar.len();
    let content = |span: &[String]| {
        span.iter()
            .any(|w| !STOPWORDS.contains(&w.as_str()) || marked(w))
    };
    for xl in 1..len {
        let xs = &ar[..xl];
        if &br[len - xl..] != xs {
            continue;
        }
        for yl in 1..=len - xl {
            let ys = &ar[len - yl..];
            let m = &ar[xl..len - yl];
            if &br[..yl] != ys || &br[yl..len - xl] != m || xs == ys {
                continue;
            }
            if !content(xs) || !content(ys) {
                continue;
            }
            if m.is_empty() {
                // Neighbours trading places: only two names or numbers count.
                if xl > 1 || yl > 1 || !marked(&xs[0]) || !marked(&ys[0]) {
                    continue;
                }
            } else {
                let m: Vec<&str> = m.iter().map(String::as_str).collect();
                if SYMMETRIC.contains(&m.as_slice()) {
                    continue;
                }
            }
            return true;
        }
    }
    false
}
