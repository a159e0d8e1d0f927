//! The gate's rules, one test per kind, and its cost.

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
        "operator",
        "currency",
        "date",
        "negation",
        "antonym",
        "entity",
        "direction",
        "order",
        "scope",
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

/// The gate's steps on `a` and `b`, and its verdict, over the whole texts.
fn work(a: &str, b: &str) -> (u64, GateVerdict) {
    STEPS.with(|s| s.set(0));
    let verdict = judge(a, b);
    let _ = substitution::substitution(a, b);
    (STEPS.with(|s| s.get()), verdict)
}

/// Prompts that reach every rule: prefixed words, antonyms, entities, plurals, a
/// hyphenated prefix and a roman numeral (one side's in lower case) all through, and the
/// same verdict however often they repeat.
fn long_pair(repeats: usize) -> (String, String) {
    let a = "Then we unlock the Berlin gateway, disconnect the Madrid routers and reactivate \
             Oslo's accounts so the team can upload reports for the self-employed Louis XIV. ";
    let b = "So the team can upload reports for the self-employed Louis xiv, we unlock the \
             Berlin gateway, disconnect the Madrid routers and reactivate Oslo's accounts. ";
    (a.repeat(repeats), b.repeat(repeats))
}

#[test]
fn work_grows_linearly_with_the_text() {
    let (a, b) = long_pair(1);
    assert_eq!(gate(&a, &b), GateVerdict::Pass);
    let (a, b) = long_pair(100);
    let (n, verdict) = work(&a, &b);
    assert_eq!(verdict, GateVerdict::Pass);
    let (a, b) = long_pair(200);
    let (two_n, verdict) = work(&a, &b);
    assert_eq!(verdict, GateVerdict::Pass);
    assert!(n > 20_000, "{n}");
    // Rescanning one side for each word of the other would give about 4n.
    assert!(two_n <= 2 * n, "n: {n}, 2n: {two_n}");
}

#[test]
fn megabyte_prompts_are_judged_whole_and_read_only_up_to_the_cap() {
    let (a, b) = long_pair(9_000);
    assert!(a.len() > 1_000_000 && b.len() > 1_000_000);
    let (whole, verdict) = work(&a, &b);
    assert_eq!(verdict, GateVerdict::Pass);
    assert_eq!(gate(&a, &b), GateVerdict::Pass);
    // Through `gate`, a prompt costs what its first MAX_TEXT_BYTES cost.
    STEPS.with(|s| s.set(0));
    gate(&a, &b);
    let capped_work = STEPS.with(|s| s.get());
    STEPS.with(|s| s.set(0));
    gate(capped(&a), capped(&b));
    assert_eq!(capped_work, STEPS.with(|s| s.get()));
    assert!(
        capped_work * 20 < whole,
        "capped {capped_work}, whole {whole}"
    );
    // A difference beyond the cap is not read.
    let late = format!("{a} Then ask about Rome.");
    assert_eq!(gate(&late, &b), GateVerdict::Pass);
    assert_eq!(judge(&late, &b), GateVerdict::Reject("entity"));
}

#[test]
fn operators_currencies_signs_and_magnitudes_are_caught() {
    rejects("What is 12 + 4?", "What is 12 - 4?", "operator");
    rejects("What is 12*4?", "What is 12/4?", "operator");
    rejects("What is 12 plus 4?", "What is 12 minus 4?", "operator");
    rejects(
        "What is 12 times 4?",
        "What is 12 divided by 4?",
        "operator",
    );
    rejects("Is x > 5 here?", "Is x < 5 here?", "operator");
    rejects("Is x >= 5 here?", "Is x > 5 here?", "operator");
    rejects(
        "How much is $100 in euros?",
        "How much is \u{a3}100 in euros?",
        "currency",
    );
    rejects(
        "Convert 100 dollars to yen",
        "Convert 100 pounds to yen",
        "currency",
    );
    rejects("Is -5 less than 3?", "Is 5 less than 3?", "number");
    rejects("What is (-5) squared?", "What is (5) squared?", "number");
    rejects(
        "What is 5 million divided by 2?",
        "What is 5 billion divided by 2?",
        "number",
    );
    rejects("Raise $5m or $5bn?", "Raise $5m or $5k?", "number");
    rejects(
        "I have a hundred dollars",
        "I have a thousand dollars",
        "number",
    );
    rejects("What is 1e3 squared?", "What is 1e9 squared?", "number");
    rejects(
        "what is 0x1f in decimal",
        "what is 0xff in decimal",
        "number",
    );
    rejects(
        "how do I install python2 on ubuntu",
        "how do I install python3 on ubuntu",
        "number",
    );
    rejects(
        "is sha1 still safe to use",
        "is sha256 still safe to use",
        "number",
    );
    rejects("how do I enable ipv4", "how do I enable ipv6", "number");
    // The same thing written otherwise passes.
    passes("What is 12 + 4?", "What is 12 plus 4?");
    passes("What is 12+4?", "What is 12 + 4 ?");
    passes("What is 12 + 4?", "Add 4 to 12, what do you get?");
    passes(
        "Convert \u{a3}50 to dollars",
        "Convert fifty pounds to dollars",
    );
    passes("Is 10k a lot of steps?", "Is 10,000 a lot of steps?");
    passes("Is 5 million a lot?", "Is 5,000,000 a lot?");
    passes("What is covid-19?", "what is covid 19?");
    passes("Explain gpt-4 briefly", "Briefly explain gpt-4");
    passes(
        "What's the range 1-10 for?",
        "What's the range 1-10 used for?",
    );
    // Kinds of writing that are not changes.
    passes("Is -5 degrees cold?", "Is minus five degrees cold?");
    passes("Is -5 degrees cold?", "Is negative 5 degrees cold?");
    passes("Is 4.1 million a lot?", "Is 4,100,000 a lot?");
    passes("Is 2.05 billion a lot?", "Is 2,050,000,000 a lot?");
    passes("Solve 3x + 5 = 20", "Solve 3x plus 5 equals 20");
    passes("What day is 2024-01-15?", "What day is 2024/01/15?");
    passes(
        "How do I install k8s locally?",
        "How do I install k8s on a laptop locally?",
    );
    passes("What does i18n mean?", "What does i18n stand for?");
    rejects(
        "Is 2024-01-15 a Monday?",
        "Is 2024-01-16 a Monday?",
        "number",
    );
    rejects("What is 12 minus 4?", "What is 12 plus 4?", "operator");
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

/// Roman numerals in capitals are numbers, wherever a text's case says nothing about
/// names (Title Case), and a numeral is not also a name.
#[test]
fn roman_numerals_are_numbers() {
    rejects(
        "How many wives did Henry VIII have?",
        "How many wives did Henry VII have?",
        "number",
    );
    // Title Case: capitals name nothing here, so only the numbers tell them apart.
    rejects(
        "What Happens In Star Wars Episode IV",
        "What Happens In Star Wars Episode VI",
        "number",
    );
    rejects(
        "What changed in Windows XP Service Pack II?",
        "What changed in Windows XP Service Pack III?",
        "number",
    );
    // The same number written two ways is the same number (before, "II" was a name
    // missing from the other side).
    passes(
        "What are the early symptoms of type II diabetes?",
        "What are the early symptoms of type 2 diabetes?",
    );
    // The same numeral in lower case, in a shouted text or with a possessive.
    passes("What caused World War II?", "what caused world war ii?");
    passes(
        "How many wives did Henry VIII have?",
        "HOW MANY WIVES DID HENRY VIII HAVE?",
    );
    passes(
        "Who were Henry VIII's wives?",
        "Who were the wives of Henry VIII?",
    );
    rejects(
        "What caused World War II?",
        "what caused world war iii?",
        "number",
    );
}

/// Words that leave out what follows count as a negation.
#[test]
fn exclusions_are_negations() {
    rejects(
        "Which fruits are high in fibre?",
        "Which fruits other than apples are high in fibre?",
        "negation",
    );
    rejects(
        "What can I recycle in the blue bin?",
        "What can I recycle in the blue bin except glass?",
        "negation",
    );
    passes(
        "Which fruits except apples are high in fibre?",
        "Which fruits other than apples are high in fibre?",
    );
    // Python's keyword is no exclusion.
    passes(
        "How does try/except work in Python?",
        "How does exception handling work in Python?",
    );
    passes(
        "How do I use except KeyError to catch a missing key?",
        "How do I catch a KeyError for a missing key?",
    );
}

/// A modifying prefix on one side only names something else.
#[test]
fn modifying_prefixes_are_caught() {
    rejects(
        "Can self-employed people claim sick pay?",
        "Can employed people claim sick pay?",
        "antonym",
    );
    rejects(
        "Is my pension taken from my pre-tax pay?",
        "Is my pension taken from my post-tax pay?",
        "antonym",
    );
    rejects(
        "Do I need to tell my ex-partner if I move abroad?",
        "Do I need to tell my partner if I move abroad?",
        "antonym",
    );
    passes(
        "Can self employed people claim sick pay?",
        "Can self-employed people claim sick pay?",
    );
    passes(
        "Why is self-compassion hard to learn?",
        "Why is it hard to learn compassion for yourself?",
    );
    // Prefixes other than self- and ex- count only against their opposite: alone they
    // are as often reworded.
    passes(
        "How do I load a pre-trained model in PyTorch?",
        "How do I load a trained model in PyTorch?",
    );
    passes(
        "What is the best anti-virus software?",
        "What is the best virus protection software?",
    );
    passes(
        "What is a good self-hosted wiki?",
        "What is a good wiki hosted on my own server?",
    );
    passes(
        "Can I stay friends with my ex-wife?",
        "Can I stay friends with my former wife?",
    );
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
fn arguments_swapped_around_any_connective_are_caught() {
    // Comparisons, arithmetic, who-did-what-to-whom, possessives, conversions without
    // "from", names side by side: one rule, whatever joins the two.
    for (a, b) in [
        ("Is gold heavier than lead?", "Is lead heavier than gold?"),
        ("What is 7 minus 3?", "What is 3 minus 7?"),
        ("Did Rome conquer Carthage?", "Did Carthage conquer Rome?"),
        (
            "Who is my sister's husband to me?",
            "Who is my husband's sister to me?",
        ),
        (
            "How many ounces are in a pound?",
            "How many pounds are in an ounce?",
        ),
        ("Is a violin a fiddle?", "Is a fiddle a violin?"),
        (
            "What does a GBP/JPY rate of 190 mean?",
            "What does a JPY/GBP rate of 190 mean?",
        ),
        (
            "Does a tenant owe notice to the landlord?",
            "Does the landlord owe notice to a tenant?",
        ),
        (
            "Should I stretch before I run?",
            "Should I run before I stretch?",
        ),
    ] {
        let verdict = gate(a, b);
        assert!(
            matches!(verdict, GateVerdict::Reject("order" | "direction")),
            "{a} | {b}: {verdict:?}"
        );
        assert_eq!(gate(b, a), verdict, "symmetric");
    }
    rejects(
        "Can I plug a 12V lamp into a 24V socket?",
        "Can I plug a 24V lamp into a 12V socket?",
        "order",
    );
    // Names that fold like plurals keep their letters.
    rejects(
        "Should I proxy HTTP to HTTPS in Caddy?",
        "Should I proxy HTTPS to HTTP in Caddy?",
        "order",
    );
}

#[test]
fn reorders_that_keep_the_meaning_pass() {
    passes(
        "What are the differences between cats and dogs?",
        "What are the differences between dogs and cats?",
    );
    passes(
        "Should I use tabs or spaces?",
        "Should I use spaces or tabs?",
    );
    passes(
        "In Rust, how do I read a file?",
        "How do I read a file in Rust?",
    );
    passes(
        "What is the best laptop for students?",
        "What laptop is best for students?",
    );
    passes(
        "What are the best budget laptops for students?",
        "What are the budget best laptops for students?",
    );
    passes(
        "How can I quickly learn Spanish?",
        "How can I learn Spanish quickly?",
    );
}

#[test]
fn scope_changes_are_caught() {
    for (a, b) in [
        (
            "How much vitamin D do seniors need?",
            "How much vitamin D do teenagers need?",
        ),
        (
            "How much does a gym cost per week?",
            "How much does a gym cost per month?",
        ),
        ("Is every prime number odd?", "Is any prime number odd?"),
        ("Do most birds migrate?", "Do all birds migrate?"),
        (
            "What is the average height of a giraffe?",
            "What is the maximum height of a giraffe?",
        ),
        (
            "How many calories are in a cup of rice?",
            "How many calories are in a pound of rice?",
        ),
        (
            "Show the release history as a table.",
            "Show the release history as a numbered list.",
        ),
        (
            "Describe photosynthesis in one sentence.",
            "Describe photosynthesis in one paragraph.",
        ),
        (
            "Write a formal apology to a client.",
            "Write a casual apology to a client.",
        ),
        (
            "Plan a cheap weekend in Lisbon.",
            "Plan a luxury weekend in Lisbon.",
        ),
    ] {
        rejects(a, b, "scope");
    }
    // "first" is also a number; either rule may name it.
    assert!(!gate("What was the first iPhone?", "What was the latest iPhone?").is_pass());
}

#[test]
fn the_same_scope_in_other_words_passes() {
    passes(
        "What is the annual fee for the card?",
        "What is the yearly fee for the card?",
    );
    passes(
        "Do I need any tools to fix a tap?",
        "Do I need tools to fix a tap?",
    );
    passes(
        "What are some great sci-fi novels?",
        "What are the most great sci-fi novels?",
    );
    passes(
        "What do most people forget when moving house?",
        "What are some things most people forget when moving house?",
    );
    passes(
        "What's the best album of all time?",
        "What's the greatest album ever?",
    );
    passes(
        "How much water should kids drink?",
        "How much water should children drink?",
    );
    // A class filled on one side only is the embedding's call, not the gate's.
    passes(
        "How much is a gym membership?",
        "How much is a gym membership per month?",
    );
}
