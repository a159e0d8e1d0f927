//! The gate's word knowledge: the word lists it matches against (negations, number words,
//! dates, phrasal verbs, antonyms, stopwords) and the lookups and normalisations of a single
//! word (possessives, plurals, inflections). Nothing here looks at a word's context.

use std::collections::HashMap;
use std::sync::OnceLock;

/// Words that are capitalised without naming anything.
pub(super) const NOT_ENTITIES: &[&str] = &[
    "i", "i'm", "i'd", "i've", "i'll", "ok", "okay", "hi", "hello", "hey", "thanks", "please",
];

/// Weekdays, months, seasons, parts of the day and relative days, singular. "may" and
/// "march" are left out: they are also verbs, and count only by their case (see
/// `features::date_word`).
pub(super) const DATES: &[&str] = &[
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
    "weekday",
    "weekend",
    "today",
    "tomorrow",
    "yesterday",
    "tonight",
    "january",
    "february",
    "april",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
    "spring",
    "summer",
    "autumn",
    "winter",
    "morning",
    "afternoon",
    "evening",
    "midnight",
    "noon",
];

/// Words that carry little meaning, left out of the direction check and of substitutions.
pub(super) const STOPWORDS: &[&str] = &[
    "a", "an", "the", "my", "your", "our", "their", "his", "her", "its", "this", "that", "these",
    "those", "i", "me", "we", "you", "it", "is", "are", "was", "be", "do", "does", "did", "can",
    "could", "should", "would", "will", "how", "what", "what's", "whats", "which", "when", "where",
    "who", "why", "of", "for", "on", "in", "at", "by", "with", "and", "or", "from", "over", "much",
    "many", "long", "get", "go", "some", "all", "any", "want", "need", "like", "i'd", "i'm",
    "i've", "there", "it's", "way",
];

/// Whether a word negates: a negation word, an "n't" contraction, or a "non" prefix.
pub(super) fn is_negation(w: &str) -> bool {
    const WORDS: &[&str] = &[
        "not", "no", "never", "without", "none", "nothing", "nobody", "nowhere", "neither", "nor",
        "cannot", "non", "avoid", "dont", "cant", "wont", "isnt", "arent", "doesnt", "didnt",
        "shouldnt", "wouldnt", "couldnt", "havent", "hasnt", "wasnt", "werent", "aint", "mustnt",
        "neednt",
    ];
    // "nonrefundable", "nonmembers" negate; "nonetheless", "nonprofit" do not.
    let non_prefixed = w.starts_with("non")
        && w.len() > 6
        && !["nonsense", "nonetheless", "nonprofit"]
            .iter()
            .any(|x| w.starts_with(x));
    WORDS.contains(&w) || w.ends_with("n't") || non_prefixed
}

/// The value of a unit or tens number word ("seven" → 7, "forty" → 40).
pub(super) fn unit_word(w: &str) -> Option<u64> {
    const UNITS: &[&str] = &[
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: &[&str] = &[
        "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    ];
    if let Some(i) = UNITS.iter().position(|u| *u == w) {
        return Some(i as u64);
    }
    TENS.iter()
        .position(|t| *t == w)
        .map(|i| (i as u64 + 2) * 10)
}

/// The value of a scale word ("thousand" → 1000).
pub(super) fn scale_word(w: &str) -> Option<u64> {
    match w {
        "thousand" | "thousands" => Some(1_000),
        "million" | "millions" => Some(1_000_000),
        "billion" | "billions" => Some(1_000_000_000),
        "trillion" | "trillions" => Some(1_000_000_000_000),
        _ => None,
    }
}

/// An arithmetic operator written as a word after a number ("12 plus 4", "12 divided by
/// 4", "3 equals 3"), as its symbol.
pub(super) fn operator_word(w: &str) -> Option<&'static str> {
    match w {
        "plus" => Some("+"),
        "minus" => Some("-"),
        "times" | "multiplied" => Some("*"),
        "divided" => Some("/"),
        "equals" | "equal" => Some("="),
        _ => None,
    }
}

/// A currency named as a word or code ("dollars", "EUR"), by name.
pub(super) fn currency_word(w: &str) -> Option<&'static str> {
    match w {
        "dollar" | "dollars" | "usd" => Some("dollar"),
        "cad" => Some("cad"),
        "aud" => Some("aud"),
        "pound" | "pounds" | "gbp" | "quid" => Some("pound"),
        "euro" | "euros" | "eur" => Some("euro"),
        "yen" | "jpy" => Some("yen"),
        "rupee" | "rupees" | "inr" => Some("rupee"),
        "yuan" | "rmb" | "cny" => Some("yuan"),
        "franc" | "francs" | "chf" => Some("franc"),
        _ => None,
    }
}

/// The position an ordinal word names ("third" → 3), up to "tenth".
pub(super) fn ordinal_word(w: &str) -> Option<u64> {
    const ORDINALS: &[&str] = &[
        "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
        "tenth",
    ];
    ORDINALS.iter().position(|o| *o == w).map(|i| i as u64 + 1)
}

/// Verbs whose particle decides the meaning ("check in" / "check out").
pub(super) const PHRASAL_VERBS: &[&str] = &[
    "opt",
    "log",
    "logged",
    "logging",
    "sign",
    "signed",
    "check",
    "checking",
    "checked",
    "turn",
    "turning",
    "switch",
    "switching",
    "plug",
    "clock",
    "zoom",
    "scroll",
    "scale",
    "move",
    "cash",
    "phase",
    "shut",
    "roll",
    "speed",
    "slow",
    "power",
    "top",
];

/// Particles that, after a phrasal verb, are joined to it ("opt in" → "opt_in").
pub(super) const PARTICLES: &[&str] = &["in", "out", "on", "off", "up", "down", "into"];

/// Opposites. Each word also matches its inflections ("increase" ~ "increased",
/// "increasing", "increases"); phrasal verbs appear joined ("opt_in").
pub(super) const ANTONYMS: &[(&str, &str)] = &[
    ("open", "close"),
    ("open", "closed"),
    ("open", "shut"),
    ("include", "exclude"),
    ("inclusive", "exclusive"),
    ("cover", "exclude"),
    ("allow", "ban"),
    ("allow", "block"),
    ("allow", "prohibit"),
    ("allow", "forbid"),
    ("allow", "deny"),
    ("permit", "ban"),
    ("permit", "prohibit"),
    ("permit", "forbid"),
    ("enable", "disable"),
    ("show", "hide"),
    ("visible", "hidden"),
    ("public", "private"),
    ("safe", "dangerous"),
    ("legal", "illegal"),
    ("lawful", "unlawful"),
    ("valid", "invalid"),
    ("correct", "incorrect"),
    ("eligible", "ineligible"),
    ("possible", "impossible"),
    ("compatible", "incompatible"),
    ("benefit", "drawback"),
    ("benefit", "downside"),
    ("benefit", "disadvantage"),
    ("advantage", "disadvantage"),
    ("advantage", "drawback"),
    ("advantage", "downside"),
    ("pro", "con"),
    ("upside", "downside"),
    ("strength", "weakness"),
    ("increase", "decrease"),
    ("increase", "reduce"),
    ("increase", "lower"),
    ("raise", "lower"),
    ("raise", "reduce"),
    ("grow", "shrink"),
    ("expand", "collapse"),
    ("expand", "shrink"),
    ("maximise", "minimise"),
    ("maximize", "minimize"),
    ("max", "min"),
    ("maximum", "minimum"),
    ("most", "least"),
    ("more", "less"),
    ("more", "fewer"),
    ("best", "worst"),
    ("better", "worse"),
    ("good", "bad"),
    ("high", "low"),
    ("higher", "lower"),
    ("highest", "lowest"),
    ("big", "small"),
    ("bigger", "smaller"),
    ("biggest", "smallest"),
    ("large", "small"),
    ("larger", "smaller"),
    ("largest", "smallest"),
    ("long", "short"),
    ("longer", "shorter"),
    ("longest", "shortest"),
    ("fast", "slow"),
    ("faster", "slower"),
    ("fastest", "slowest"),
    ("quick", "slow"),
    ("quickest", "slowest"),
    ("easy", "hard"),
    ("easy", "difficult"),
    ("cheap", "expensive"),
    ("hot", "cold"),
    ("warm", "cold"),
    ("heat", "cool"),
    ("spicy", "mild"),
    ("busy", "quiet"),
    ("loud", "quiet"),
    ("light", "dark"),
    ("light", "heavy"),
    ("wet", "dry"),
    ("full", "empty"),
    ("full", "part"),
    ("permanent", "temporary"),
    ("upgrade", "downgrade"),
    ("upload", "download"),
    ("import", "export"),
    ("encrypt", "decrypt"),
    ("add", "remove"),
    ("add", "delete"),
    ("add", "subtract"),
    ("add", "withdraw"),
    ("insert", "remove"),
    ("attach", "detach"),
    ("join", "leave"),
    ("join", "quit"),
    ("enrol", "withdraw"),
    ("enroll", "withdraw"),
    ("hire", "fire"),
    ("arrive", "depart"),
    ("arrival", "departure"),
    ("entry", "exit"),
    ("enter", "exit"),
    ("inbound", "outbound"),
    ("incoming", "outgoing"),
    ("input", "output"),
    ("send", "receive"),
    ("push", "pull"),
    ("buy", "sell"),
    ("purchase", "sell"),
    ("lend", "borrow"),
    ("deposit", "withdraw"),
    ("credit", "debit"),
    ("pause", "resume"),
    ("start", "stop"),
    ("start", "end"),
    ("start", "finish"),
    ("begin", "end"),
    ("begin", "finish"),
    ("stop", "continue"),
    ("stop", "resume"),
    ("accept", "decline"),
    ("accept", "reject"),
    ("accept", "refuse"),
    ("approve", "reject"),
    ("approve", "decline"),
    ("approve", "deny"),
    ("grant", "revoke"),
    ("grant", "deny"),
    ("confirm", "cancel"),
    ("pass", "fail"),
    ("succeed", "fail"),
    ("success", "failure"),
    ("successful", "unsuccessful"),
    ("win", "lose"),
    ("won", "lost"),
    ("positive", "negative"),
    ("true", "false"),
    ("compulsory", "optional"),
    ("mandatory", "optional"),
    ("required", "optional"),
    ("free", "paid"),
    ("online", "offline"),
    ("internal", "external"),
    ("domestic", "international"),
    ("men", "women"),
    ("man", "woman"),
    ("male", "female"),
    ("boy", "girl"),
    ("husband", "wife"),
    ("mother", "father"),
    ("mum", "dad"),
    ("son", "daughter"),
    ("brother", "sister"),
    ("adult", "child"),
    ("adult", "children"),
    ("adult", "kid"),
    ("adult", "baby"),
    ("adult", "infant"),
    ("above", "below"),
    ("over", "under"),
    ("inside", "outside"),
    ("within", "after"),
    ("within", "outside"),
    ("before", "after"),
    ("early", "late"),
    ("earlier", "later"),
    ("earliest", "latest"),
    ("first", "last"),
    ("previous", "next"),
    ("last", "next"),
    ("past", "future"),
    ("same", "next"),
    ("same", "different"),
    ("top", "bottom"),
    ("front", "back"),
    ("left", "right"),
    ("north", "south"),
    ("east", "west"),
    ("up", "down"),
    ("upstairs", "downstairs"),
    ("ascending", "descending"),
    ("asc", "desc"),
    ("opt_in", "opt_out"),
    ("log_in", "log_out"),
    ("sign_in", "sign_out"),
    ("sign_up", "sign_out"),
    ("check_in", "check_out"),
    ("turn_on", "turn_off"),
    ("switch_on", "switch_off"),
    ("power_on", "power_off"),
    ("plug_in", "unplug"),
    ("clock_in", "clock_out"),
    ("zoom_in", "zoom_out"),
    ("scroll_up", "scroll_down"),
    ("scale_up", "scale_down"),
    ("turn_up", "turn_down"),
    ("speed_up", "slow_down"),
    ("roll_out", "roll_back"),
    ("log_on", "log_off"),
    ("move_in", "move_out"),
    ("cash_in", "cash_out"),
];

/// Inflection suffixes folded when matching a word against a list entry.
pub(super) const SUFFIXES: &[&str] = &[
    "", "s", "es", "d", "ed", "ing", "er", "ers", "est", "ment", "ments", "ion", "ions", "ation",
    "able", "ly",
];

/// True if `word` is `base` or an inflection of it ("increasing" ~ "increase",
/// "stopped" ~ "stop", "kids" ~ "kid").
fn inflects(word: &str, base: &str) -> bool {
    if word == base {
        return true;
    }
    // Joined phrasal forms match exactly only.
    if base.contains('_') {
        return false;
    }
    // "increase" → "increas" + "ing".
    let stems = [Some(base), base.strip_suffix('e')];
    for stem in stems.into_iter().flatten() {
        let Some(rest) = word.strip_prefix(stem) else {
            continue;
        };
        if SUFFIXES.contains(&rest) {
            return true;
        }
        // A doubled final consonant: "stop" → "stopped", "win" → "winning".
        if let Some(last) = stem.chars().last() {
            if let Some(after) = rest.strip_prefix(last) {
                if !after.is_empty() && SUFFIXES.contains(&after) {
                    return true;
                }
            }
        }
    }
    false
}

/// The words of [`ANTONYMS`] that `word` is or inflects (see [`inflects`]). Found by
/// stripping each suffix `word` may carry and looking the stem up, so the cost does not grow
/// with the list: a prompt's words are each looked up a fixed number of times.
pub(super) fn antonym_bases(word: &str) -> Vec<&'static str> {
    static BY_STEM: OnceLock<HashMap<&'static str, Vec<&'static str>>> = OnceLock::new();
    let by_stem = BY_STEM.get_or_init(|| {
        let mut m: HashMap<&'static str, Vec<&'static str>> = HashMap::new();
        for base in ANTONYMS.iter().flat_map(|(x, y)| [*x, *y]) {
            for stem in [Some(base), base.strip_suffix('e')].into_iter().flatten() {
                let bases = m.entry(stem).or_default();
                if !bases.contains(&base) {
                    bases.push(base);
                }
            }
        }
        m
    });
    super::steps(SUFFIXES.len());
    let mut out = Vec::new();
    let mut look = |stem: &str| {
        for base in by_stem.get(stem).into_iter().flatten() {
            if !out.contains(base) && inflects(word, base) {
                out.push(*base);
            }
        }
    };
    for suffix in SUFFIXES {
        let Some(stem) = word.strip_suffix(suffix) else {
            continue;
        };
        look(stem);
        // A doubled final consonant: "stopped" is "stop" + "p" + "ed".
        if let Some(last) = stem.chars().last().filter(|_| !suffix.is_empty()) {
            let shorter = &stem[..stem.len() - last.len_utf8()];
            if shorter.ends_with(last) {
                look(shorter);
            }
        }
    }
    out
}

/// A word without its possessive ending ("mary's" → "mary", "users'" → "users").
pub(super) fn strip_possessive(w: &str) -> &str {
    w.strip_suffix("'s")
        .or_else(|| w.strip_suffix('\''))
        .unwrap_or(w)
}

/// A plural folded to its singular by dropping one final "s" ("kids" → "kid"); words
/// ending in "ss" and very short stems are left alone ("boss", "us").
pub(super) fn singular(w: &str) -> &str {
    match w.strip_suffix('s') {
        Some(stem) if stem.len() >= 2 && !stem.ends_with('s') => stem,
        _ => w,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflections_fold_onto_the_base() {
        assert!(inflects("increasing", "increase"));
        assert!(inflects("stopped", "stop"));
        assert!(inflects("kids", "kid"));
        assert!(inflects("opt_in", "opt_in"));
        assert!(!inflects("opt_ins", "opt_in"));
        assert!(!inflects("stopwatch", "stop"));
    }

    #[test]
    fn antonym_bases_are_the_entries_a_word_inflects() {
        let words = ANTONYMS.iter().flat_map(|(x, y)| [*x, *y]);
        let mut forms: Vec<String> = Vec::new();
        for w in words {
            for s in SUFFIXES {
                forms.push(format!("{w}{s}"));
                if let Some(stem) = w.strip_suffix('e') {
                    forms.push(format!("{stem}{s}"));
                }
                if let Some(last) = w.chars().last() {
                    forms.push(format!("{w}{last}{s}"));
                }
            }
        }
        forms.extend(["stopwatch", "opt_ins", "under", "kids", "x", ""].map(String::from));
        for form in &forms {
            let mut expected: Vec<&str> = ANTONYMS
                .iter()
                .flat_map(|(x, y)| [*x, *y])
                .filter(|base| inflects(form, base))
                .collect();
            expected.sort();
            expected.dedup();
            let mut found = antonym_bases(form);
            found.sort();
            assert_eq!(found, expected, "{form}");
        }
        assert_eq!(antonym_bases("stopped"), ["stop"]);
        assert!(antonym_bases("increasing").contains(&"increase"));
    }

    #[test]
    fn negations_and_word_forms() {
        for w in ["not", "can't", "dont", "nonrefundable", "without"] {
            assert!(is_negation(w), "{w}");
        }
        for w in ["nonetheless", "nonprofit", "nonsense", "note"] {
            assert!(!is_negation(w), "{w}");
        }
        assert_eq!(strip_possessive("mary's"), "mary");
        assert_eq!(strip_possessive("users'"), "users");
        assert_eq!(singular("kids"), "kid");
        assert_eq!(singular("boss"), "boss");
        assert_eq!(singular("us"), "us");
        assert_eq!(unit_word("forty"), Some(40));
        assert_eq!(unit_word("seventeen"), Some(17));
        assert_eq!(scale_word("million"), Some(1_000_000));
        assert_eq!(ordinal_word("third"), Some(3));
    }
}
