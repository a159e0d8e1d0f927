//! The words two near-identical prompts swap ("home insurance" / "car insurance"), for
//! the caller to compare by meaning: a textual check cannot tell a synonym from another
//! subject.

use std::collections::HashSet;

use super::features::tokenize;
use super::lexicon::{singular, strip_possessive, STOPWORDS};

/// The content words two prompts do not share, when they differ by a substitution: one to
/// three content words on each side, and at least one shared content word. A gate check
/// cannot tell "shop"/"store" (same question) from "home"/"car" insurance (another question):
/// the caller compares the two sides' meanings (e.g. with the embedder) and rejects the
/// candidate when they are far apart. `None` when the prompts do not differ that way.
/// Like the gate, it reads at most [`super::MAX_TEXT_BYTES`] of each prompt.
pub fn substitution(query: &str, candidate: &str) -> Option<(String, String)> {
    fn content(text: &str) -> Vec<String> {
        tokenize(text)
            .into_iter()
            .map(|t| t.lower)
            .filter(|w| !STOPWORDS.contains(&w.as_str()) && !w.is_empty())
            .map(|w| singular(strip_possessive(&w)).to_string())
            .collect()
    }
    let a = content(super::capped(query));
    let b = content(super::capped(candidate));
    let (set_a, set_b): (HashSet<&String>, HashSet<&String>) =
        (a.iter().collect(), b.iter().collect());
    super::steps(a.len() + b.len());
    let only_a: Vec<&String> = a.iter().filter(|w| !set_b.contains(w)).collect();
    let only_b: Vec<&String> = b.iter().filter(|w| !set_a.contains(w)).collect();
    let shared = a.iter().any(|w| set_b.contains(w));
    let small = |v: &Vec<&String>| (1..=3).contains(&v.len());
    if !(shared && small(&only_a) && small(&only_b)) {
        return None;
    }
    let join = |v: Vec<&String>| v.into_iter().cloned().collect::<Vec<_>>().join(" ");
    Some((join(only_a), join(only_b)))
}

#[cfg(test)]
mod tests {
    use super::substitution;

    #[test]
    fn finds_substituted_words() {
        assert_eq!(
            substitution(
                "What does my home insurance cover?",
                "What does my car insurance cover?"
            ),
            Some(("home".into(), "car".into()))
        );
        assert_eq!(
            substitution("Which shop sells stamps?", "Which store sells stamps?"),
            Some(("shop".into(), "store".into()))
        );
        // Identical content, or nothing shared: not a substitution.
        assert_eq!(
            substitution("How do I reset my password?", "how do i reset my password"),
            None
        );
        assert_eq!(
            substitution("Reset password", "Weather in Paris today"),
            None
        );
    }
}
