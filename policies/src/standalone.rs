//! Whether the last message of a conversation stands on its own.
//!
//! A question that does not refer back ("What is the boiling point of water at sea level?")
//! has the same answer whatever was said before it in an unrelated conversation, so it may
//! match entries asked as standalone questions in any context of the same namespace, system
//! prompt and model. One that refers back ("How tall is it?", "Translate that to French",
//! "What are the early warning signs?") is matched only within its own context.
//!
//! The text rules here are the cheap half of the decision; the server adds the other half,
//! by meaning: the question must also be unrelated to the last exchanges (see
//! `semantic.standalone_max_related`), which catches implicit follow-ups no word marks ("How
//! many nations competed?" after a question about the Olympics). Every rule errs towards
//! "refers back": a wrong "standalone" could serve an answer written for another
//! conversation, a wrong "refers back" only costs a hit.
//!
//! [`refers_back`] says a message refers back when any of these holds:
//! - it has fewer than [`MIN_WORDS`] words ("Why?", "And in French?");
//! - it opens with a connective that continues a thought ("and", "but", "so", "also",
//!   "what about", "how about", "what if", "why not");
//! - it has a pronoun, demonstrative or anaphoric word ([`REFERENCES`]: it, they, he, she,
//!   this, that, these, those, such, above, again, also, too, else, another, same, more,
//!   further, elaborate, continue, other, ...);
//! - "how many" + a verb with no noun between ("How many are in the set?");
//! - nothing names its topic: no name (a capitalised word after the first), no number, no
//!   quoted text and no prepositional complement ("How many nations competed?", "Can you
//!   give some tips?" refer back; "What is the speed of sound in water?" does not);
//! - it asks to transform something without saying what: a transform verb (translate,
//!   summarise, rewrite, shorten, explain, ...) opening the request, after any politeness
//!   ("please", "can you"), with nothing between it and a preposition, an adverb or the end
//!   ("Translate into French please.", "Summarise in 3 bullet points.", "Explain in simple
//!   terms"), or a transform noun (summary, translation, version, ...) not followed by "of"
//!   ("Give me a summary in 3 bullet points");
//! - a definite noun phrase that does not name what it means by itself: "the" + words with
//!   no name or number, not opening with a superlative and not followed by "of" ("What are
//!   the early warning signs?", "Translate the list into Italian", "How do I get from the
//!   airport to the city centre?" refer back; "What is the boiling point of water?", "Who
//!   won the 2018 World Cup?", "What is the best way to learn Rust?" do not).
//!
//! [`conversation_is_plain`] says whether the earlier user messages leave nothing behind that
//! could shape a later answer: each is a question (ends with "?") and none gives a standing
//! instruction, by a phrase ("from now on", "always answer in ...") or as a request about how
//! the assistant is to answer ("Can you talk like a pirate?", "Could you keep answers under
//! 20 words?": a request opening with "can/could/would/will you" or "please" whose verb is
//! one of manner, [`MANNER_VERBS`]). A statement such as "I'm learning Python." makes "Write a
//! function that ..." depend on it, so it keeps the context.

/// The fewest words a standalone question has.
pub const MIN_WORDS: usize = 4;

/// Words that point back into the conversation.
pub const REFERENCES: &[&str] = &[
    "it",
    "its",
    "it's",
    "itself",
    "they",
    "them",
    "their",
    "theirs",
    "they're",
    "themselves",
    "he",
    "him",
    "his",
    "himself",
    "he's",
    "she",
    "her",
    "hers",
    "herself",
    "she's",
    "this",
    "that",
    "that's",
    "these",
    "those",
    "such",
    "former",
    "latter",
    "above",
    "aforementioned",
    "again",
    "also",
    "too",
    "else",
    "another",
    "same",
    "previous",
    "earlier",
    "instead",
    // Asking for more of what was said: "Can you tell me more?", "Please elaborate."
    "more",
    "further",
    "elaborate",
    "expand",
    "continue",
    "rest",
    "other",
    "others",
];

/// Connectives that open a continuation.
const OPENERS: &[&[&str]] = &[
    &["and"],
    &["but"],
    &["so"],
    &["or"],
    &["also"],
    &["then"],
    &["plus"],
    &["what", "about"],
    &["how", "about"],
    &["what", "if"],
    &["why", "not"],
];

/// Prepositions whose complement anchors a question ("the capital *of France*").
const PREPOSITIONS: &[&str] = &[
    "of", "for", "in", "on", "about", "with", "at", "from", "between", "to", "into", "during",
    "after", "before", "by", "under", "over", "without", "against", "per",
];

/// Verbs right after "how many" that leave out the noun.
const AUXILIARIES: &[&str] = &[
    "are", "is", "were", "was", "do", "does", "did", "can", "should", "will", "would", "have",
    "has",
];

/// Verbs that ask for a transformation of something said earlier when nothing follows them.
const TRANSFORM_VERBS: &[&str] = &[
    "translate",
    "summarise",
    "summarize",
    "rewrite",
    "rephrase",
    "paraphrase",
    "reword",
    "shorten",
    "simplify",
    "condense",
    "expand",
    "explain",
    "clarify",
    "proofread",
    "correct",
    "fix",
    "edit",
    "improve",
    "format",
    "reformat",
    "convert",
    "repeat",
    "redo",
    "retry",
    "tabulate",
    "outline",
    "restate",
    "polish",
    "tidy",
    "lengthen",
];

/// Nouns naming a transformation of something, which say what only with "of".
const TRANSFORM_NOUNS: &[&str] = &[
    "summary",
    "translation",
    "version",
    "rewrite",
    "recap",
    "tldr",
    "paraphrase",
    "explanation",
    "outline",
    "rundown",
    "breakdown",
];

/// Words of politeness that may come before a request's verb.
const POLITE: &[&str] = &[
    "please", "pls", "kindly", "now", "ok", "okay", "can", "could", "would", "will", "you", "u",
    "just",
];

/// Words after a transform verb that are not its object.
const NOT_OBJECTS: &[&str] = &[
    "please",
    "briefly",
    "simply",
    "now",
    "quickly",
    "again",
    "differently",
    "better",
    "concisely",
    "formally",
    "informally",
    "properly",
    "as",
    "like",
    "using",
    "so",
    "for",
    "in",
    "into",
    "to",
    "with",
    "without",
    "on",
    "at",
    "by",
];

/// Verbs of a request about how the assistant answers from then on ("Can you talk like a
/// pirate?"). Broad on purpose: a request read as one only keeps the conversation's context
/// (a lost hit at worst).
pub const MANNER_VERBS: &[&str] = &[
    "talk", "speak", "respond", "reply", "replying", "answer", "keep", "limit", "use", "be", "act",
    "pretend", "stop", "start", "switch", "sound", "address", "call", "format", "avoid", "make",
    "write", "mind",
];

/// Words that introduce what a transform request is about ("Explain in simple terms *how*
/// vaccines work").
const CLAUSE_OPENERS: &[&str] = &[
    "how", "what", "why", "who", "whom", "whose", "where", "when", "which", "whether", "if",
];

/// Verbs that ask for a transform noun ("give me a summary").
const REQUEST_VERBS: &[&str] = &[
    "give", "write", "make", "provide", "send", "show", "need", "want", "produce", "create", "do",
    "prepare",
];

/// Phrases of a standing instruction in a user message.
const INSTRUCTIONS: &[&str] = &[
    "from now on",
    "going forward",
    "for the rest",
    "in future",
    "in the future",
    "always ",
    "never ",
    "answer in",
    "reply in",
    "respond in",
    "remember",
    "pretend",
    "act as",
    "you are",
    "you're",
];

/// The most bytes of a message the rules read; a longer message is taken as referring back
/// (questions that stand on their own are short, and the rules stay bounded).
pub const MAX_BYTES: usize = 4096;

/// One word of a message: lower-cased, and whether it was capitalised.
struct Word {
    lower: String,
    cased: bool,
    digit: bool,
}

fn words(text: &str) -> Vec<Word> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '\u{2019}'))
        .map(|w| w.trim_matches(|c| c == '\'' || c == '\u{2019}'))
        .filter(|w| !w.is_empty())
        .map(|w| Word {
            lower: w.replace('\u{2019}', "'").to_lowercase(),
            cased: w.chars().any(char::is_uppercase),
            digit: w.chars().any(|c| c.is_ascii_digit()),
        })
        .collect()
}

/// Whether `text` (the last user message) refers back to the conversation (see the module).
pub fn refers_back(text: &str) -> bool {
    if text.len() > MAX_BYTES {
        return true;
    }
    let w = words(text);
    if w.len() < MIN_WORDS {
        return true;
    }
    let lower: Vec<&str> = w.iter().map(|x| x.lower.as_str()).collect();
    if OPENERS.iter().any(|o| lower.starts_with(o)) {
        return true;
    }
    if lower.iter().any(|x| REFERENCES.contains(x)) {
        return true;
    }
    if lower
        .windows(3)
        .any(|t| t[0] == "how" && t[1] == "many" && AUXILIARIES.contains(&t[2]))
    {
        return true;
    }
    if unanchored_definite(&w) || transform_without_object(&lower) {
        return true;
    }
    // A question of its own names its topic somewhere.
    let named = w.iter().skip(1).any(|x| x.cased && x.lower != "i") || w.iter().any(|x| x.digit);
    let quoted = text.contains('"') || text.contains('\u{201c}');
    let complement = lower.windows(2).any(|t| {
        PREPOSITIONS.contains(&t[0])
            && !REFERENCES.contains(&t[1])
            && !matches!(
                t[1],
                "a" | "an" | "me" | "you" | "us" | "him" | "her" | "them"
            )
    });
    !(named || quoted || complement)
}

/// Whether some "the" opens a noun phrase (the words up to a preposition, a reference or the
/// end) that does not name what it means by itself. It does when it holds a name or a number
/// ("the 2018 World Cup", "the Moon"), opens with a superlative ("the best way", "the
/// largest"), or is followed by "of" ("the capital of France"). "the list", "the airport",
/// "the maximum daily dose for an adult" do not: they point at something the conversation set
/// up. One pass from the end, so a message of many "the"s costs no more than its words.
fn unanchored_definite(w: &[Word]) -> bool {
    let boundary = |x: &Word| {
        PREPOSITIONS.contains(&x.lower.as_str()) || REFERENCES.contains(&x.lower.as_str())
    };
    let superlative = |x: &Word| {
        matches!(x.lower.as_str(), "best" | "worst" | "most" | "least")
            || (x.lower.ends_with("est") && x.lower.len() > 4)
    };
    // Of the words after the current one, up to the nearest boundary: whether one is a name
    // or a number, whether there are any, and whether that boundary is "of".
    let (mut named, mut empty, mut then_of) = (false, true, false);
    for i in (0..w.len()).rev() {
        if w[i].lower == "the" {
            let first = (!empty).then(|| &w[i + 1]);
            if !(named || first.is_some_and(superlative) || then_of) {
                return true;
            }
        }
        let x = &w[i];
        if boundary(x) {
            (named, empty, then_of) = (false, true, x.lower == "of");
        } else {
            named |= (x.cased && x.lower != "i") || x.digit;
            empty = false;
        }
    }
    false
}

/// Whether the message asks to transform something without saying what (see the module):
/// its first word past politeness is a transform verb followed by no object (and no clause of
/// its own), or it asks for a transform noun not followed by "of".
fn transform_without_object(lower: &[&str]) -> bool {
    let start = lower
        .iter()
        .position(|x| !POLITE.contains(x))
        .unwrap_or(lower.len());
    let verb = lower
        .get(start)
        .is_some_and(|x| TRANSFORM_VERBS.contains(x));
    // What follows names the object when a clause of its own does ("how vaccines work").
    let clause = || lower[start..].iter().any(|x| CLAUSE_OPENERS.contains(x));
    if verb && lower.get(start + 1).is_none_or(|x| NOT_OBJECTS.contains(x)) && !clause() {
        return true;
    }
    // "Give me a summary", "Can you write a shorter version": the noun is what is asked for,
    // and names nothing without "of".
    lower.iter().enumerate().any(|(i, x)| {
        TRANSFORM_NOUNS.contains(x)
            && lower.get(i + 1).is_none_or(|n| *n != "of")
            && lower[i.saturating_sub(4)..i]
                .iter()
                .any(|w| REQUEST_VERBS.contains(w))
    })
}

/// Whether the earlier user messages leave nothing behind that could shape a later answer:
/// each is a question and none gives a standing instruction (see the module).
pub fn conversation_is_plain<'a>(user_messages: impl IntoIterator<Item = &'a str>) -> bool {
    user_messages.into_iter().all(|m| {
        let t = m.trim();
        if t.len() > MAX_BYTES || !t.ends_with('?') {
            return false;
        }
        let lower = t.to_lowercase();
        !INSTRUCTIONS.iter().any(|i| lower.contains(i)) && !asks_a_manner(&lower)
    })
}

/// A request about how the assistant is to answer: "can/could/would/will you" or "please"
/// (after any "so", "ok", "hey"), then a verb of [`MANNER_VERBS`] ("Can you talk like a
/// pirate?", "Could you keep answers short?", "Please use metric units?").
fn asks_a_manner(lower: &str) -> bool {
    let w: Vec<&str> = lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .take(8)
        .collect();
    let start = w
        .iter()
        .position(|x| !matches!(*x, "so" | "ok" | "okay" | "hey" | "hi" | "and" | "also"))
        .unwrap_or(w.len());
    let rest = &w[start..];
    let verb_at = match rest {
        ["can" | "could" | "would" | "will", "you" | "we", ..] => 2,
        ["please", ..] => 1,
        _ => return false,
    };
    // "Can you please talk ...", "Could you always answer ...".
    rest[verb_at..]
        .iter()
        .find(|x| !matches!(**x, "please" | "kindly" | "always" | "just" | "now"))
        .is_some_and(|v| MANNER_VERBS.contains(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_that_name_their_topic_stand_alone() {
        for q in [
            "What is the boiling point of water at sea level?",
            "Who won the 2018 World Cup?",
            "How do I reset a forgotten Wi-Fi password?",
            "What is the capital of Australia?",
            "How many legs does a spider have in total?",
            "What is the best way to learn Rust?",
            "How far is the Moon from the Earth?",
        ] {
            assert!(!refers_back(q), "{q}");
        }
    }

    #[test]
    fn follow_ups_refer_back() {
        for q in [
            "How tall is it?",
            "Translate that to German.",
            "Why?",
            "And in Spanish?",
            "What about the second one?",
            "Make them shorter please.",
            "Summarise the above in a sentence.",
            "How many are in the box?",
            "What are the main risks?",
            "How long should I let the dough rest?",
            "Can you explain that again?",
            "Where was he born?",
            "Translate the list into Italian.",
            "How do I get from the airport to the city centre?",
            "What is the maximum dose for an adult?",
            "Can you tell me more?",
            "Please elaborate on why.",
            "What are some other options?",
            "How many nations competed?",
            "Which one should I choose?",
            "Translate into French please.",
            "Summarise in 3 bullet points.",
            "Can you explain in simple terms?",
            "Please rewrite for a ten year old.",
            "Give me a summary in 3 bullet points.",
            "Could you give me a shorter version?",
        ] {
            assert!(refers_back(q), "{q}");
        }
        // A transform that says what it transforms stands alone.
        for q in [
            "Translate 'good morning' into French.",
            "Summarise the history of the Roman Empire.",
            "Explain photosynthesis in simple terms.",
            "Give me a summary of World War II.",
            "Explain in simple terms how vaccines work.",
            "How do I check my Python version on Linux?",
            "What version control system should I use for Rust?",
        ] {
            assert!(!refers_back(q), "{q}");
        }
        assert!(refers_back(&"word ".repeat(2000)), "too long to read");
    }

    #[test]
    fn one_pass_over_definite_articles_decides_as_a_rescan_would() {
        // What the pass replaces: for each "the", a scan to the nearest boundary.
        fn rescan(w: &[Word]) -> bool {
            (0..w.len()).any(|i| {
                if w[i].lower != "the" {
                    return false;
                }
                let after = &w[i + 1..];
                let end = after
                    .iter()
                    .position(|x| {
                        PREPOSITIONS.contains(&x.lower.as_str())
                            || REFERENCES.contains(&x.lower.as_str())
                    })
                    .unwrap_or(after.len());
                let np = &after[..end];
                let anchored = np.iter().any(|x| (x.cased && x.lower != "i") || x.digit)
                    || np.first().is_some_and(|x| {
                        matches!(x.lower.as_str(), "best" | "worst" | "most" | "least")
                            || (x.lower.ends_with("est") && x.lower.len() > 4)
                    })
                    || after.get(end).is_some_and(|x| x.lower == "of");
                !anchored
            })
        }
        for q in [
            "Who won the 2018 World Cup in the UK?",
            "What are the early warning signs?",
            "What is the boiling point of water at the top of Everest?",
            "Translate the list into Italian.",
            "What is the best way to learn the guitar?",
            "How far is the the Moon from the Earth?",
            "the the the",
            "the",
            "Is the largest the best of the the list for it?",
        ] {
            let w = words(q);
            assert_eq!(unanchored_definite(&w), rescan(&w), "{q}");
        }
        let long = format!(
            "{}Paris? {}",
            "the ".repeat(600),
            "the list of ".repeat(150)
        );
        let w = words(&long);
        assert_eq!(unanchored_definite(&w), rescan(&w));
    }

    #[test]
    fn a_conversation_of_plain_questions_leaves_nothing_behind() {
        assert!(conversation_is_plain([
            "Who wrote Dracula?",
            "When was it published?"
        ]));
        assert!(!conversation_is_plain(["I'm learning Rust."]));
        assert!(!conversation_is_plain([
            "From now on, answer in French. OK?"
        ]));
        assert!(!conversation_is_plain(["Always use metric units, okay?"]));
        // A request about how to answer, asked as a question, stands too.
        for m in [
            "Can you talk like a pirate?",
            "Could you keep answers under 20 words?",
            "Would you please use British spelling?",
            "So can you be more formal?",
            "Can you make your answers shorter?",
            "Could you write in British English?",
            "Would you mind replying in Spanish?",
            "Can we keep it brief?",
        ] {
            assert!(!conversation_is_plain([m]), "{m}");
        }
        assert!(conversation_is_plain([
            "Can you explain how a rainbow forms?",
            "Could you name the planets in order?"
        ]));
        assert!(conversation_is_plain(std::iter::empty()));
    }
}
