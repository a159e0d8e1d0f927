//! The `scope` rule: the same question over a different scope — a quantifier (all / some /
//! most), a period (per month / per year), a group of people (adults / children), a
//! position (first / last), a statistic (average / longest), a unit (litre / gallon), or a
//! constraint on the answer itself (a format, a length unit, a register, a price tier).
//!
//! Each [`CLASS`] is a closed set of words that fill one slot of a question; words of one
//! class that mean the same fold onto one value ("annually" and "yearly" → year, "kids" →
//! child). When both prompts fill a class and the values they give it differ, the answers
//! differ: "How much calcium do adults need?" / "... do children need?", "Are all wild
//! mushrooms poisonous?" / "Are any ...?", "summarise as a bulleted list" / "... as a short
//! essay". A class filled on one side only is not a difference (many fillers are optional:
//! "Do I need any tools?" / "Do I need tools?"); that is the embedding's part. "some" and
//! "any" are weak: beside a strong quantifier on the same side they add nothing ("some facts
//! most people don't know" is about what most people know), and "the most" is a
//! superlative, not a quantifier.
//!
//! Only prompts of at most [`MAX_TOKENS`] words are compared: in long passages these words
//! come and go with the wording (a paraphrased paragraph says "all" where the original said
//! "entirely").

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use super::lexicon::{singular, strip_possessive};

/// The longest prompt, in words, the rule compares.
pub(super) const MAX_TOKENS: usize = 40;

/// A class: its name and its words with the value each folds onto.
type Class = (&'static str, &'static [(&'static str, &'static str)]);

/// The classes (see the module). A word may open a two-word form ("per annum", "high end"):
/// such forms are listed joined by `_`.
pub(super) const CLASSES: &[Class] = &[
    (
        "quantifier",
        &[
            ("all", "all"),
            ("every", "all"),
            ("each", "all"),
            ("entire", "all"),
            ("whole", "all"),
            ("any", "some"),
            ("some", "some"),
            ("few", "some"),
            ("most", "most"),
            ("majority", "most"),
        ],
    ),
    (
        "period",
        &[
            ("second", "second"),
            ("minute", "minute"),
            ("hour", "hour"),
            ("hourly", "hour"),
            ("day", "day"),
            ("daily", "day"),
            ("week", "week"),
            ("weekly", "week"),
            ("fortnight", "fortnight"),
            ("month", "month"),
            ("monthly", "month"),
            ("quarter", "quarter"),
            ("quarterly", "quarter"),
            ("year", "year"),
            ("yearly", "year"),
            ("annual", "year"),
            ("annually", "year"),
            ("per_annum", "year"),
            ("decade", "decade"),
            ("century", "century"),
        ],
    ),
    (
        "people",
        &[
            ("baby", "baby"),
            ("babie", "baby"),
            ("infant", "baby"),
            ("newborn", "baby"),
            ("toddler", "toddler"),
            ("child", "child"),
            ("children", "child"),
            ("kid", "child"),
            ("teen", "teen"),
            ("teenager", "teen"),
            ("adolescent", "teen"),
            ("adult", "adult"),
            ("grown_up", "adult"),
            ("senior", "senior"),
            ("elderly", "senior"),
            ("beginner", "beginner"),
            ("novice", "beginner"),
            ("newbie", "beginner"),
            ("expert", "expert"),
            ("professional", "expert"),
            ("man", "male"),
            ("men", "male"),
            ("male", "male"),
            ("boy", "male"),
            ("woman", "female"),
            ("women", "female"),
            ("female", "female"),
            ("girl", "female"),
        ],
    ),
    (
        "position",
        &[
            ("first", "first"),
            ("earliest", "first"),
            ("initial", "first"),
            ("early", "first"),
            ("last", "last"),
            ("latest", "last"),
            ("final", "last"),
            ("late", "last"),
            ("next", "next"),
            ("previous", "previous"),
        ],
    ),
    (
        "statistic",
        &[
            ("average", "average"),
            ("typical", "average"),
            ("median", "median"),
            ("maximum", "max"),
            ("max", "max"),
            ("longest", "max"),
            ("highest", "max"),
            ("biggest", "max"),
            ("largest", "max"),
            ("minimum", "min"),
            ("min", "min"),
            ("shortest", "min"),
            ("lowest", "min"),
            ("smallest", "min"),
            ("total", "total"),
        ],
    ),
    (
        "unit",
        &[
            ("litre", "litre"),
            ("liter", "litre"),
            ("millilitre", "millilitre"),
            ("milliliter", "millilitre"),
            ("ml", "millilitre"),
            ("gallon", "gallon"),
            ("quart", "quart"),
            ("pint", "pint"),
            ("cup", "cup"),
            ("tablespoon", "tablespoon"),
            ("teaspoon", "teaspoon"),
            ("ounce", "ounce"),
            ("oz", "ounce"),
            ("pound", "pound"),
            ("lb", "pound"),
            ("kilogram", "kilogram"),
            ("kg", "kilogram"),
            ("gram", "gram"),
            ("tonne", "tonne"),
            ("ton", "ton"),
            ("mile", "mile"),
            ("kilometre", "kilometre"),
            ("kilometer", "kilometre"),
            ("km", "kilometre"),
            ("metre", "metre"),
            ("meter", "metre"),
            ("centimetre", "centimetre"),
            ("centimeter", "centimetre"),
            ("cm", "centimetre"),
            ("foot", "foot"),
            ("feet", "foot"),
            ("inch", "inch"),
            ("inche", "inch"),
            ("yard", "yard"),
            ("celsius", "celsius"),
            ("fahrenheit", "fahrenheit"),
            ("kelvin", "kelvin"),
            ("mph", "mph"),
            ("kph", "kph"),
        ],
    ),
    (
        "format",
        &[
            ("bulleted", "list"),
            ("bullet", "list"),
            ("numbered", "list"),
            ("table", "table"),
            ("json", "json"),
            ("yaml", "yaml"),
            ("csv", "csv"),
            ("xml", "xml"),
            ("markdown", "markdown"),
            ("essay", "essay"),
            ("prose", "prose"),
            ("poem", "poem"),
            ("haiku", "haiku"),
            ("tweet", "tweet"),
            ("email", "email"),
            ("letter", "letter"),
            ("formula", "formula"),
            ("example", "example"),
            ("definition", "definition"),
            ("summary", "summary"),
            ("outline", "outline"),
            ("proof", "proof"),
            ("diagram", "diagram"),
        ],
    ),
    (
        "length",
        &[
            ("sentence", "sentence"),
            ("paragraph", "paragraph"),
            ("word", "word"),
            ("line", "line"),
            ("page", "page"),
            ("character", "character"),
        ],
    ),
    (
        "register",
        &[
            ("formal", "formal"),
            ("informal", "casual"),
            ("casual", "casual"),
            ("simple", "plain"),
            ("plain", "plain"),
            ("layman", "plain"),
            ("technical", "technical"),
            ("precise", "technical"),
            ("clinical", "technical"),
            ("funny", "funny"),
            ("humorous", "funny"),
            ("serious", "serious"),
        ],
    ),
    (
        "price",
        &[
            ("cheap", "cheap"),
            ("budget", "cheap"),
            ("shoestring", "cheap"),
            ("affordable", "cheap"),
            ("inexpensive", "cheap"),
            ("luxury", "luxury"),
            ("luxurious", "luxury"),
            ("expensive", "luxury"),
            ("premium", "luxury"),
            ("high_end", "luxury"),
        ],
    ),
];

/// Every class word with its class index and value.
fn table() -> &'static HashMap<&'static str, (usize, &'static str)> {
    static TABLE: OnceLock<HashMap<&'static str, (usize, &'static str)>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = HashMap::new();
        for (c, (_, members)) in CLASSES.iter().enumerate() {
            for (m, v) in *members {
                t.insert(*m, (c, *v));
            }
        }
        t
    })
}

/// The values a prompt's words give each class: `(class index, value)`.
pub(super) fn values(words: &[String]) -> Vec<(usize, &'static str)> {
    super::steps(words.len());
    let t = table();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = strip_possessive(&words[i]);
        let prev = i.checked_sub(1).map(|j| words[j].as_str());
        let next = words.get(i + 1).map(String::as_str);
        // "the most beautiful" is a superlative; "of all time" quantifies nothing.
        if (w == "most" && matches!(prev, Some("the" | "absolute")))
            || (w == "all" && next == Some("time"))
        {
            i += 1;
            continue;
        }
        if let Some(n) = next {
            let pair = format!("{w}_{}", strip_possessive(n));
            if let Some(v) = t.get(pair.as_str()) {
                out.push(*v);
                i += 2;
                continue;
            }
        }
        if let Some(v) = t.get(w).or_else(|| t.get(singular(w))) {
            out.push(*v);
        }
        i += 1;
    }
    out
}

/// The first class in which each side has a value the other lacks, by name.
pub(super) fn differs(
    a: &[(usize, &'static str)],
    b: &[(usize, &'static str)],
) -> Option<&'static str> {
    for (c, (name, _)) in CLASSES.iter().enumerate() {
        // The class's values as a multiset: value → how many times.
        let of = |x: &[(usize, &'static str)]| {
            let mut v: BTreeMap<&str, usize> = BTreeMap::new();
            for (_, value) in x.iter().filter(|(k, _)| *k == c) {
                *v.entry(value).or_default() += 1;
            }
            // A weak quantifier beside a strong one adds nothing.
            if *name == "quantifier" && v.len() > 1 {
                v.remove("some");
            }
            v
        };
        let (va, vb) = (of(a), of(b));
        let lacks = |x: &BTreeMap<&str, usize>, y: &BTreeMap<&str, usize>| {
            x.iter().any(|(v, n)| y.get(v).copied().unwrap_or(0) < *n)
        };
        // Each side gives the class a value the other lacks: "hours per week" / "hours per
        // year" differ, "in one year, compounded monthly" / "in one year, compounded
        // annually" too (year twice against once); "days of leave after 5 years" / "leave
        // after five years" do not (the second has no value the first lacks).
        if lacks(&va, &vb) && lacks(&vb, &va) {
            return Some(name);
        }
    }
    None
}
