//! The surface features of one prompt that the gate compares: its words (tokenised, with
//! sentence and clause starts), numbers (digits with their sign and magnitude, number words,
//! times, ordinals, roman numerals in capitals), the operators between numbers and the
//! currencies named, date words, negations (exclusions among them), entities (capitalised
//! words), quoted strings, content words with phrasal verbs joined, and words hyphenated to
//! a modifying prefix.

use super::lexicon::{
    currency_word, is_negation, operator_word, ordinal_word, scale_word, strip_possessive,
    unit_word, DATES, NOT_ENTITIES, PARTICLES, PHRASAL_VERBS,
};

/// One word of a prompt.
#[derive(Debug, Clone)]
pub(super) struct Token {
    /// Lower-cased, apostrophes normalised, possessive `'s` kept.
    pub(super) lower: String,
    /// Has an upper-case letter somewhere (Paris, macOS, UK).
    pub(super) cased: bool,
    /// Every letter upper-case, two letters at least, a possessive's "s" aside (UK, XLIX,
    /// VIII's; not "I", "Paris").
    pub(super) upper: bool,
    /// Joined by a hyphen to the word before ("employed" in "self-employed").
    pub(super) hyphened: bool,
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
    /// Normalised numbers ("50", "7pm", "9:15", "3th", "-5", "5000000" for "5 million",
    /// "10000" for "10k"), and the digits inside words ("python3" → "3").
    pub(super) numbers: Vec<String>,
    /// Operators between numbers, by symbol or word ("12 + 4", "12 plus 4", "x > 5"),
    /// normalised to their symbol.
    pub(super) operators: Vec<&'static str>,
    /// Currencies, by symbol or word ("$", "dollars", "EUR"), normalised to a name.
    pub(super) currencies: Vec<&'static str>,
    /// The numbers of `numbers` read from roman numerals, with the numeral's lower-cased
    /// text: the other side may have the same numeral in lower case or in a shouted text,
    /// where it is read as a word ("World War II" / "world war ii").
    pub(super) romans: Vec<(String, String)>,
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
    /// Words hyphenated to a modifying prefix ([`MODIFYING_PREFIXES`]), as "prefix-word"
    /// ("self-employed", "ex-wife", "pre-tax").
    pub(super) compounds: Vec<String>,
    /// Lower-cased words with possessives stripped and phrasal verbs joined ("opt_in").
    pub(super) words: Vec<String>,
}

impl Features {
    /// Extracts the features of one prompt.
    pub(super) fn of(text: &str) -> Features {
        let tokens = tokenize(text);
        super::steps(tokens.len());
        let (operators, currencies) = symbols(text);
        let mut f = Features {
            quotes: quoted(text),
            operators,
            currencies,
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
        let all_caps = !text.chars().any(char::is_lowercase);
        let caseless = all_caps || (inner.len() >= 3 && capitalised * 5 > inner.len() * 3);

        let mut words: Vec<String> = Vec::with_capacity(tokens.len());
        // Whether the token before was a number (an operator word between numbers counts).
        let mut after_number = false;
        // Whether the token before was a sign word: the number right after it is negative.
        let mut sign_next = false;
        let mut i = 0;
        while i < tokens.len() {
            let negate = std::mem::take(&mut sign_next);
            let t = &tokens[i];
            let w = strip_possessive(&t.lower);
            if let Some(c) = currency_word(w) {
                f.currencies.push(c);
            }
            if let Some(op) = operator_word(w).filter(|_| after_number) {
                f.operators.push(op);
            }
            // "minus five", "negative 5": a sign, not an operator, where no number precedes.
            let signed = matches!(w, "minus" | "negative") && !after_number;
            let counted = f.numbers.len();
            // A roman numeral is compared as a number, not as a name.
            let mut numeral = false;
            // "No, it doesn't ..." / "Yes, ...": an answer word, not a negation.
            let interjection = t.sentence_start
                && matches!(t.lower.as_str(), "no" | "nope")
                && tokens.get(i + 1).is_none_or(|n| n.clause_start);
            if (is_negation(&t.lower) && !interjection) || excludes(&tokens, i) {
                f.negations += 1;
            }
            if let Some(c) = compound(&tokens, i) {
                f.compounds.push(c);
            }
            if let Some(n) = number_token(&t.lower) {
                let n = negated(n, negate);
                // "7 pm" → "7pm"; "5 million" → "5000000".
                let next = tokens.get(i + 1).map(|n| n.lower.as_str());
                match next {
                    Some(s @ ("am" | "pm")) => {
                        f.numbers.push(format!("{n}{s}"));
                        i += 1;
                    }
                    Some(s) if magnitude(s).is_some() => {
                        f.numbers.push(scaled(&n, magnitude(s).unwrap_or(1)));
                        i += 1;
                    }
                    _ => f.numbers.push(n),
                }
            } else if let Some((value, used)) = number_words(&tokens[i..]) {
                if used == 1 && t.lower == "one" {
                    f.ones_from_word += 1;
                }
                f.numbers.push(negated(value, negate));
                after_number = true;
                i += used;
                continue;
            } else if let Some(n) = roman_numeral(&tokens, i).filter(|_| !all_caps) {
                f.numbers.push(n.to_string());
                f.romans.push((n.to_string(), w.to_string()));
                numeral = true;
            } else {
                // Digits ending a word name a version or a variant: "python3", "ipv6".
                f.numbers.extend(inner_digits(&t.lower));
            }
            sign_next = signed;
            after_number = f.numbers.len() > counted
                && t.lower
                    .starts_with(|c: char| c.is_ascii_digit() || c == '-');
            // "Morning! How do I ..." is a greeting, not a time.
            let greeting = t.sentence_start && tokens.get(i + 1).is_none_or(|n| n.clause_start);
            if let Some(d) = date_word(w, t, caseless).filter(|_| !greeting) {
                f.dates.push(d);
            }
            if t.cased && !t.sentence_start && !caseless && !numeral && !NOT_ENTITIES.contains(&w) {
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
            '\u{2212}' => '-',
            c => c,
        })
        .collect();
    let mut out = Vec::new();
    // The last character that is not whitespace, before the current one.
    let mut visible: Option<char> = None;
    let mut current = String::new();
    let mut cased = false;
    let mut hyphened = false;
    let mut sentence_start = true;
    let mut clause_start = true;
    let mut pending_sentence = true;
    let mut pending_clause = true;
    let flush = |current: &mut String,
                 (cased, hyphened): (&mut bool, bool),
                 out: &mut Vec<Token>,
                 sentence: &mut bool,
                 clause: &mut bool| {
        if !current.is_empty() {
            // A possessive's "s" leaves a word in capitals ("VIII's").
            let core = current
                .strip_suffix("'s")
                .or_else(|| current.strip_suffix("'S"))
                .unwrap_or(current);
            let letters = core.chars().filter(|c| c.is_alphabetic()).count();
            out.push(Token {
                lower: current.to_lowercase(),
                cased: *cased,
                upper: letters >= 2 && !core.chars().any(char::is_lowercase),
                hyphened,
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
        // A minus sign: before a digit, not after a word, a digit or a bracket ("-5", "(-5)",
        // "x=-5"; not "12-4", "12 - 4" or "covid-19").
        let sign = c == '-'
            && current.is_empty()
            && next.is_some_and(|n| n.is_ascii_digit())
            && !prev.is_some_and(|p| p.is_alphanumeric() || p == ')')
            && !visible.is_some_and(|v| v.is_ascii_digit() || v == ')');
        if !c.is_whitespace() {
            visible = Some(c);
        }
        let keep = c.is_alphanumeric()
            || sign
            || (c == '\'' && !current.is_empty() && next.is_some_and(char::is_alphabetic))
            || (matches!(c, '.' | ',' | ':')
                && prev.is_some_and(|p| p.is_ascii_digit())
                && next.is_some_and(|n| n.is_ascii_digit())
                && !current.is_empty());
        if keep {
            if current.is_empty() {
                hyphened = prev == Some('-')
                    && i.checked_sub(2).is_some_and(|j| chars[j].is_alphanumeric());
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
            (&mut cased, hyphened),
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
        (&mut cased, hyphened),
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
/// "3rd" → "3th"; "7pm" → "7pm"; "-5" → "-5"; "10k" → "10000"; "1e3" → "1000"; "0x1f" as
/// it is; "10gb" → "10" (units are not numbers).
fn number_token(w: &str) -> Option<String> {
    let (sign, w) = match w.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", w),
    };
    let first = w.chars().next()?;
    if !first.is_ascii_digit() {
        return None;
    }
    if w.len() > 2 && w.starts_with("0x") {
        return Some(format!("{sign}{w}"));
    }
    let digits_end = w
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | ',' | ':')))
        .unwrap_or(w.len());
    let (num, rest) = w.split_at(digits_end);
    let num: String = num.chars().filter(|&c| c != ',').collect();
    let num = format!("{sign}{}", num.trim_end_matches(['.', ':']));
    let exponent = rest
        .strip_prefix('e')
        .filter(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()));
    Some(match rest {
        "am" | "pm" => format!("{num}{rest}"),
        "st" | "nd" | "rd" | "th" => format!("{num}th"),
        _ => match (exponent, magnitude(rest)) {
            (Some(e), _) => match e.parse::<u32>() {
                Ok(e) => scaled(&num, e),
                Err(_) => format!("{num}e{e}"),
            },
            (None, Some(m)) => scaled(&num, m),
            (None, None) => num,
        },
    })
}

/// `n` with a minus sign when `negate` (and it has none).
fn negated(n: String, negate: bool) -> String {
    match negate && !n.starts_with('-') {
        true => format!("-{n}"),
        false => n,
    }
}

/// The power of ten a word or suffix after a number multiplies it by: "million" 6, "k" 3,
/// "bn" 9.
fn magnitude(w: &str) -> Option<u32> {
    match w {
        "hundred" => Some(2),
        "k" => Some(3),
        "bn" => Some(9),
        _ => scale_word(w).map(u64::ilog10),
    }
}

/// The most zeros [`scaled`] writes out; a larger power stays as written.
const MAX_ZEROS: u32 = 30;

/// `num` (digits, maybe a sign and a decimal point) times ten to the `zeros`, written
/// exactly by moving the decimal point ("4.1" and 6 → "4100000", "2.05" and 9 →
/// "2050000000", "1.2345" and 2 → "123.45").
fn scaled(num: &str, zeros: u32) -> String {
    if zeros > MAX_ZEROS {
        return format!("{num}e{zeros}");
    }
    let (sign, digits) = match num.strip_prefix('-') {
        Some(d) => ("-", d),
        None => ("", num),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let zeros = zeros as usize;
    let (int, frac) = if frac.len() <= zeros {
        (format!("{int}{frac}{}", "0".repeat(zeros - frac.len())), "")
    } else {
        (format!("{int}{}", &frac[..zeros]), &frac[zeros..])
    };
    let int = int.trim_start_matches('0');
    let int = if int.is_empty() { "0" } else { int };
    let frac = frac.trim_end_matches('0');
    match frac.is_empty() {
        true => format!("{sign}{int}"),
        false => format!("{sign}{int}.{frac}"),
    }
}

/// Upper-case words that read as roman numerals but are far more often abbreviations ("CD",
/// "CV", "MD", "DC", "CLI", "MIX" in a shouted word): never numbers.
const NOT_NUMERALS: &[&str] = &[
    "cc", "cd", "ci", "cl", "cli", "cm", "civ", "cv", "dc", "di", "div", "dl", "dm", "li", "lv",
    "mc", "md", "mi", "mix", "ml", "mm", "mv",
];

/// Numerals that are also common abbreviations ("an IV drip", "size XL"): numbers only
/// after a name ("Henry IV", "Super Bowl XL", "Episode VI").
const NUMERALS_AFTER_NAMES: &[&str] = &["iv", "vi", "xl"];

/// The value of token `i` when it is a roman numeral: written in capitals, two letters at
/// least ("I" is a pronoun; "World War I" against "World War II" still differs by the "II"),
/// in canonical form, 1 to 3999, and not an abbreviation ("Super Bowl XLIX" → 49, "Henry
/// VIII" → 8, "Type II" → 2).
fn roman_numeral(tokens: &[Token], i: usize) -> Option<u32> {
    let t = &tokens[i];
    let w = strip_possessive(&t.lower);
    if !t.upper || NOT_NUMERALS.contains(&w) {
        return None;
    }
    if NUMERALS_AFTER_NAMES.contains(&w) {
        let before = i.checked_sub(1).map(|j| &tokens[j]);
        if t.clause_start || !before.is_some_and(|b| b.cased && !b.upper) {
            return None;
        }
    }
    roman_value(w)
}

/// Roman numerals' symbols by value, largest first, subtractive pairs included.
const ROMAN: [(u32, &str); 13] = [
    (1000, "m"),
    (900, "cm"),
    (500, "d"),
    (400, "cd"),
    (100, "c"),
    (90, "xc"),
    (50, "l"),
    (40, "xl"),
    (10, "x"),
    (9, "ix"),
    (5, "v"),
    (4, "iv"),
    (1, "i"),
];

/// The value of a lower-case roman numeral in canonical form ("xlix" → 49; "il", "iiii" are
/// not canonical), 1 to 3999.
fn roman_value(w: &str) -> Option<u32> {
    if w.len() > 15 {
        return None;
    }
    // Read greedily by symbol; a numeral is canonical when its value writes back the same.
    let mut rest = w;
    let mut total = 0;
    for (value, symbol) in ROMAN {
        while let Some(r) = rest.strip_prefix(symbol) {
            rest = r;
            total += value;
        }
    }
    (rest.is_empty() && (1..=3999).contains(&total) && write_roman(total) == w).then_some(total)
}

/// `n` as a lower-case roman numeral.
fn write_roman(mut n: u32) -> String {
    let mut out = String::new();
    for (value, symbol) in ROMAN {
        while n >= value {
            out.push_str(symbol);
            n -= value;
        }
    }
    out
}

/// Token `i` starts words that leave out what follows ("except", "excluding", "other
/// than"): counted as a negation ("Which countries use the euro?" / "Which countries use a
/// currency other than the euro?"). Not "apart from", "aside from", "besides": as often
/// "in addition to"; not Python's `except` ("try/except", "except KeyError", "except:").
fn excludes(tokens: &[Token], i: usize) -> bool {
    let next = tokens.get(i + 1);
    match tokens[i].lower.as_str() {
        "except" => {
            let after_try = i.checked_sub(1).is_some_and(|j| tokens[j].lower == "try");
            let code = next.is_none_or(|n| {
                n.clause_start || n.lower.ends_with("error") || n.lower.ends_with("exception")
            });
            !after_try && !code
        }
        "excluding" => true,
        "other" => next.is_some_and(|t| t.lower == "than"),
        _ => false,
    }
}

/// Prefixes whose compounds the gate compares (`prefixed_once` in the gate): "self-" and
/// "ex-" name something else than the bare word ("self-employed" is not "employed",
/// "ex-wife" not "wife"); the others only against their opposite ("pre-tax" / "post-tax",
/// "pro-choice" / "anti-choice"), since alone they are as often reworded ("pre-trained" /
/// "already trained", "anti-virus" / "virus protection").
pub(super) const MODIFYING_PREFIXES: &[&str] =
    &["self", "ex", "pre", "post", "pro", "anti", "inter", "intra"];

/// The compound token `i` starts with the next one, as "prefix-word", when token `i` is a
/// [`MODIFYING_PREFIXES`] hyphenated to a word ("pre-tax", "self-employed"; written apart,
/// the prefix words stand alone too often: "post a photo", "my ex is", "self confidence").
fn compound(tokens: &[Token], i: usize) -> Option<String> {
    let prefix = tokens[i].lower.as_str();
    if !MODIFYING_PREFIXES.contains(&prefix) {
        return None;
    }
    let next = tokens
        .get(i + 1)
        .filter(|n| !n.clause_start && n.hyphened && n.lower.chars().all(char::is_alphabetic))?;
    Some(format!("{prefix}-{}", next.lower))
}

/// The digits ending a word that starts with letters: a version or a variant ("python3" →
/// "3", "sha256" → "256", "ipv6" → "6"). Digits inside a word ("k8s", "i18n") are part of
/// its spelling, not a number.
fn inner_digits(w: &str) -> Option<String> {
    let digits = w.len() - w.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let stem = &w[..w.len() - digits];
    if digits == 0 || stem.is_empty() || !stem.chars().all(char::is_alphabetic) {
        return None;
    }
    let d = w[stem.len()..].trim_start_matches('0');
    Some(if d.is_empty() { "0" } else { d }.to_string())
}

/// Whether the `-` or `/` at `i` separates the parts of a date or a code of digit groups
/// ("2024-01-15", "1/2/2024", "555-123-4567"): digits right on both sides, and the same
/// separator again within the run of digits and separators around it (read a few
/// characters each way).
fn date_separator(chars: &[char], i: usize) -> bool {
    let sep = chars[i];
    if !matches!(sep, '-' | '/') {
        return false;
    }
    let digit_at = |j: Option<usize>| {
        j.and_then(|j| chars.get(j))
            .is_some_and(char::is_ascii_digit)
    };
    if !digit_at(i.checked_sub(1)) || !digit_at(Some(i + 1)) {
        return false;
    }
    let part = |c: &&char| c.is_ascii_digit() || **c == sep;
    let left = chars[..i].iter().rev().take(12).take_while(part);
    let right = chars[i + 1..].iter().take(12).take_while(part);
    left.chain(right).filter(|c| **c == sep).count() >= 1
}

/// The operators written as symbols between numbers ("12 + 4", "12*4", "x > 5", "2^8"), and
/// the currencies written as symbols ("$5", "£"). An operator counts only next to a digit on
/// one side and a digit, a letter or a bracket on the other (a hyphen between words is no
/// minus); `-` before a number is its sign (kept with the number), not an operator.
fn symbols(text: &str) -> (Vec<&'static str>, Vec<&'static str>) {
    let chars: Vec<char> = text.chars().collect();
    let mut ops = Vec::new();
    let mut currencies = Vec::new();
    // The nearest character that is not whitespace, either side of `i`.
    let before = |i: usize| chars[..i].iter().rev().take(4).find(|c| !c.is_whitespace());
    let after = |i: usize| chars[i + 1..].iter().take(4).find(|c| !c.is_whitespace());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if let Some(name) = match c {
            '$' => Some("dollar"),
            '\u{a3}' => Some("pound"),
            '\u{20ac}' => Some("euro"),
            '\u{a5}' => Some("yen"),
            '\u{20b9}' => Some("rupee"),
            _ => None,
        } {
            currencies.push(name);
        }
        let two = chars.get(i + 1).copied();
        let (op, width) = match (c, two) {
            ('<', Some('=')) | ('\u{2264}', _) => ("<=", if c == '<' { 2 } else { 1 }),
            ('>', Some('=')) | ('\u{2265}', _) => (">=", if c == '>' { 2 } else { 1 }),
            ('!', Some('=')) | ('\u{2260}', _) => ("!=", if c == '!' { 2 } else { 1 }),
            ('=', Some('=')) => ("=", 2),
            ('+', _) => ("+", 1),
            ('-' | '\u{2212}' | '\u{2013}', _) => ("-", 1),
            ('*' | '\u{d7}', _) => ("*", 1),
            ('/' | '\u{f7}', _) => ("/", 1),
            ('^', _) => ("^", 1),
            ('<', _) => ("<", 1),
            ('>', _) => (">", 1),
            ('=', _) => ("=", 1),
            _ => ("", 1),
        };
        if !op.is_empty() {
            let (l, r) = (before(i), after(i + width - 1));
            let digit = |c: Option<&char>| c.is_some_and(|c| c.is_ascii_digit());
            let operand = |c: Option<&char>| {
                c.is_some_and(|c| c.is_alphanumeric() || matches!(c, '(' | ')' | '$' | '\u{a3}'))
            };
            // A minus right before a digit after no digit is that number's sign.
            let sign = op == "-"
                && chars.get(i + 1).is_some_and(char::is_ascii_digit)
                && !digit(l)
                && l != Some(&')');
            if !sign
                && !date_separator(&chars, i)
                && ((digit(l) && operand(r)) || (operand(l) && digit(r)))
            {
                // A hyphen between a word and a number ("covid-19", "gpt-4") is no minus.
                let word_hyphen = op == "-"
                    && i > 0
                    && chars[i - 1].is_alphabetic()
                    && chars.get(i + 1).is_some_and(|c| !c.is_whitespace());
                if !word_hyphen {
                    ops.push(op);
                }
            }
        }
        i += width;
    }
    super::steps(chars.len());
    (ops, currencies)
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
    // "a hundred", "a thousand": the article is the one.
    let article = matches!(tokens[0].lower.as_str(), "a" | "an")
        && tokens
            .get(1)
            .is_some_and(|t| t.lower == "hundred" || scale_word(&t.lower).is_some());
    if article {
        current = 1;
        used = 1;
    }
    for t in &tokens[used..] {
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
    fn roman_numerals() {
        let numbers = |t: &str| sorted(&Features::of(t).numbers);
        assert_eq!(numbers("Super Bowl LVII and MMXXIV"), vec!["2024", "57"]);
        assert_eq!(
            numbers("Louis XIV, Henry IV, Episode VI, Super Bowl XL"),
            vec!["14", "4", "40", "6"]
        );
        // Abbreviations, the pronoun, non-canonical forms, lower case and shouted texts.
        for t in [
            "Put an IV drip in, size XL",
            "Flights to Washington DC with a CD, a CV and a CLI",
            "Can I go?",
            "IIII or IL or VX",
            "henry viii",
            "HOW DO I MIX PAINT FOR LOUIS XIV",
        ] {
            assert!(numbers(t).is_empty(), "{t}: {:?}", numbers(t));
        }
        // A numeral is a number, not a name.
        let f = Features::of("Who did Henry VIII marry in the end?");
        assert_eq!(
            (f.entities, f.numbers),
            (vec!["henry".to_string()], vec!["8".to_string()])
        );
    }

    #[test]
    fn compounds_and_exclusions() {
        let compounds = |t: &str| Features::of(t).compounds;
        assert_eq!(
            compounds("My self-employed ex-wife, a co-founder, pre-tax"),
            ["self-employed", "ex-wife", "pre-tax"]
        );
        assert!(
            compounds("How do I post a photo? My ex is pre Raphaelite, self employed").is_empty()
        );
        let negations = |t: &str| Features::of(t).negations;
        assert_eq!(
            negations("All other than cats, except dogs, excluding mice"),
            3
        );
        assert_eq!(
            negations("The other way, apart from mice, aside from that"),
            0
        );
    }

    #[test]
    fn number_parsing() {
        let f =
            Features::of("Could I get a table for two at seven this evening, 2,700 kWh, £50, 3rd");
        assert_eq!(sorted(&f.numbers), vec!["2", "2700", "3th", "50", "7"]);
        let f = Features::of("twenty five or one hundred");
        assert_eq!(sorted(&f.numbers), vec!["100", "25"]);
        let f = Features::of("Is -5 more than 5 million, 10k, 1e3, 2.5 billion or a hundred?");
        assert_eq!(
            sorted(&f.numbers),
            vec!["-5", "100", "1000", "10000", "2500000000", "5000000"]
        );
        assert!(f.operators.is_empty(), "{:?}", f.operators);
        let f =
            Features::of("12 - 4, 12-4, x >= 3, 2^8, covid-19, gpt-4, well-known, $5 and 3 euros");
        assert_eq!(f.operators, ["-", "-", ">=", "^"]);
        assert_eq!(f.currencies, ["dollar", "euro"]);
        // A huge exponent or factor stays as written instead of overflowing.
        assert_eq!(Features::of("1e400").numbers, ["1e400"]);
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
