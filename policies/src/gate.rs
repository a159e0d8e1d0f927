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

/// One word of a prompt.
#[derive(Debug, Clone)]
struct Token {
    /// Lower-cased, apostrophes normalised, possessive `'s` kept.
    lower: String,
    /// Has an upper-case letter somewhere (Paris, macOS, UK).
    cased: bool,
    /// First word of the text or of a sentence (after . ! ? : ;).
    sentence_start: bool,
    /// First word after any punctuation (a clause boundary).
    clause_start: bool,
}

/// What the rules look at, computed once per prompt.
#[derive(Debug, Default)]
struct Features {
    tokens: Vec<Token>,
    /// Normalised numbers ("50", "7pm", "9:15", "3rd").
    numbers: Vec<String>,
    /// How many of `numbers` came from the word "one" (often a pronoun: "quick one").
    ones_from_word: usize,
    /// Weekdays, months, relative days ("sunday", "tomorrow", "weekend").
    dates: Vec<&'static str>,
    negations: usize,
    /// Lower-cased capitalised words, when the text's case carries information.
    entities: Vec<String>,
    /// Contents of double quotes or backticks.
    quotes: Vec<String>,
    /// Lower-cased words with possessives stripped and phrasal verbs joined ("opt_in").
    words: Vec<String>,
}

impl Features {
    fn of(text: &str) -> Features {
        let tokens = tokenize(text);
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

fn sorted<T: Ord + Clone>(v: &[T]) -> Vec<T> {
    let mut v = v.to_vec();
    v.sort();
    v
}

/// Splits into words. Apostrophes inside words are kept ("don't", "mary's"); '.', ',' and
/// ':' are kept between digits ("9:15", "2,700", "1.5"); everything else separates.
fn tokenize(text: &str) -> Vec<Token> {
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

fn same_quotes(a: &Features, b: &Features) -> bool {
    a.quotes == b.quotes
}

fn strip_possessive(w: &str) -> &str {
    w.strip_suffix("'s")
        .or_else(|| w.strip_suffix('\''))
        .unwrap_or(w)
}

/// Words that are capitalised without naming anything.
const NOT_ENTITIES: &[&str] = &[
    "i", "i'm", "i'd", "i've", "i'll", "ok", "okay", "hi", "hello", "hey", "thanks", "please",
];

fn is_negation(w: &str) -> bool {
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
            current += v;
        } else if w == "hundred" && used > 0 {
            current = current.max(1) * 100;
        } else if let Some(m) = scale_word(w).filter(|_| used > 0) {
            total += current.max(1) * m;
            current = 0;
        } else {
            break;
        }
        used += 1;
    }
    (used > 0).then(|| ((total + current).to_string(), used))
}

fn unit_word(w: &str) -> Option<u64> {
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

fn scale_word(w: &str) -> Option<u64> {
    match w {
        "thousand" => Some(1_000),
        "million" => Some(1_000_000),
        "billion" => Some(1_000_000_000),
        _ => None,
    }
}

fn ordinal_word(w: &str) -> Option<u64> {
    const ORDINALS: &[&str] = &[
        "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
        "tenth",
    ];
    ORDINALS.iter().position(|o| *o == w).map(|i| i as u64 + 1)
}

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

/// Weekdays, months, relative days. "may" and "march" count only when capitalised mid-
/// sentence (they are also a verb); plurals fold ("sundays").
fn date_word(w: &str, t: &Token, caseless: bool) -> Option<&'static str> {
    const WORDS: &[&str] = &[
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
    let singular = w.strip_suffix('s').unwrap_or(w);
    if let Some(d) = WORDS.iter().find(|d| **d == w || **d == singular) {
        return Some(d);
    }
    match w {
        "may" if t.cased && !t.sentence_start && !caseless => Some("may"),
        "march" if t.cased && !t.sentence_start && !caseless => Some("march"),
        _ => None,
    }
}

/// Verbs whose particle decides the meaning ("check in" / "check out").
const PHRASAL_VERBS: &[&str] = &[
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

const PARTICLES: &[&str] = &["in", "out", "on", "off", "up", "down", "into"];

/// Opposites. Each word also matches its inflections ("increase" ~ "increased",
/// "increasing", "increases"); phrasal verbs appear joined ("opt_in").
const ANTONYMS: &[(&str, &str)] = &[
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
const SUFFIXES: &[&str] = &[
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

fn has(words: &[String], base: &str) -> bool {
    words.iter().any(|w| inflects(w, base))
}

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

fn singular(w: &str) -> &str {
    match w.strip_suffix('s') {
        Some(stem) if stem.len() >= 2 && !stem.ends_with('s') => stem,
        _ => w,
    }
}

/// Words that carry little meaning, left out of the direction check.
const STOPWORDS: &[&str] = &[
    "a", "an", "the", "my", "your", "our", "their", "his", "her", "its", "this", "that", "these",
    "those", "i", "me", "we", "you", "it", "is", "are", "was", "be", "do", "does", "did", "can",
    "could", "should", "would", "will", "how", "what", "what's", "whats", "which", "when", "where",
    "who", "why", "of", "for", "on", "in", "at", "by", "with", "and", "or", "from", "over", "much",
    "many", "long", "get", "go", "some", "all", "any", "want", "need", "like", "i'd", "i'm",
    "i've", "there", "it's", "way",
];

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

    #[test]
    fn number_parsing() {
        let f =
            Features::of("Could I get a table for two at seven this evening, 2,700 kWh, £50, 3rd");
        assert_eq!(sorted(&f.numbers), vec!["2", "2700", "3th", "50", "7"]);
        let f = Features::of("twenty five or one hundred");
        assert_eq!(sorted(&f.numbers), vec!["100", "25"]);
    }
}

/// The content words two prompts do not share, when they differ by a substitution: one to
/// three content words on each side, and at least one shared content word. A gate check
/// cannot tell "shop"/"store" (same question) from "home"/"car" insurance (another question):
/// the caller compares the two sides' meanings (e.g. with the embedder) and rejects the
/// candidate when they are far apart. `None` when the prompts do not differ that way.
pub fn substitution(query: &str, candidate: &str) -> Option<(String, String)> {
    fn content(text: &str) -> Vec<String> {
        tokenize(text)
            .into_iter()
            .map(|t| t.lower)
            .filter(|w| !STOPWORDS.contains(&w.as_str()) && !w.is_empty())
            .map(|w| singular(strip_possessive(&w)).to_string())
            .collect()
    }
    let a = content(query);
    let b = content(candidate);
    let only_a: Vec<&String> = a.iter().filter(|w| !b.contains(w)).collect();
    let only_b: Vec<&String> = b.iter().filter(|w| !a.contains(w)).collect();
    let shared = a.iter().any(|w| b.contains(w));
    let small = |v: &Vec<&String>| (1..=3).contains(&v.len());
    if !(shared && small(&only_a) && small(&only_b)) {
        return None;
    }
    let join = |v: Vec<&String>| v.into_iter().cloned().collect::<Vec<_>>().join(" ");
    Some((join(only_a), join(only_b)))
}

#[cfg(test)]
mod substitution_tests {
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
