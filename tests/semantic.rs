//! The semantic tier over real TCP with the real ONNX embedder: paraphrases hit, traps and
//! other contexts never do. The scripted backend answers "You asked: <prompt>", so a hit's
//! body names the prompt it was generated for.

mod common;

use common::*;
use reprise::Config;
use reprise_backend::fake::ScriptConfig;
use serde_json::{json, Value};

fn semantic_config() -> Config {
    let mut c = test_config();
    c.semantic.enabled = true;
    c
}

#[tokio::test]
async fn paraphrase_is_a_semantic_hit_without_a_backend_call() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let r = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(r.headers()["cache-status"], "reprise; hit; detail=semantic");
    let sim: f32 = r.headers()["x-reprise-similarity"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(sim > 0.86 && sim <= 1.0, "{sim}");
    assert_eq!(content(r).await, "You asked: How do I reset my password?");
    assert_eq!(backend.calls(), 1);
    // An exact repeat of the paraphrase is now an exact hit.
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "exact");
    // Streaming paraphrase hits too.
    let mut b = chat_body("how can I reset my password");
    b["stream"] = json!(true);
    let r = app.chat(&b, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "You asked: How do I reset my password?");
    assert_eq!(backend.calls(), 1);
}

/// An entry reported wrong for more questions than it keeps refusals for is served by
/// meaning to none: the wordings earlier hits by meaning linked to it no longer get it as
/// exact hits either, while its own question does.
#[tokio::test]
async fn an_entry_refused_by_meaning_answers_no_linked_wording() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let (original, paraphrase) = (
        "How do I reset my password?",
        "I forgot my password, how can I change it?",
    );
    let r = app.chat(&chat_body(original), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let id: reprise_cache::EntryId = r.headers()["x-reprise-entry"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    content(r).await;
    let r = app.chat(&chat_body(paraphrase), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    content(r).await;
    let r = app.chat(&chat_body(paraphrase), &[]).await;
    assert_eq!(cache_status(&r), "exact", "linked");
    content(r).await;
    // Reported wrong for more questions than it keeps (none of them this wording).
    let mut e = (*app.state.store.get(id).await.unwrap()).clone();
    for n in 0..=reprise_cache::entry::MAX_REFUSALS as u32 {
        let key = *blake3::hash(&n.to_le_bytes()).as_bytes();
        assert!(e.refuse(reprise_cache::entry::Refusal { key, around: None }));
    }
    assert!(e.refused_by_meaning());
    app.state.store.update(std::sync::Arc::new(e)).await;
    let calls = backend.calls();
    let r = app.chat(&chat_body(paraphrase), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    content(r).await;
    assert_eq!(backend.calls(), calls + 1);
    let r = app.chat(&chat_body(original), &[]).await;
    assert_eq!(cache_status(&r), "exact", "its own question");
}

/// Words the embedder cannot spell (emoji, an overlong token) read alike, so they must match
/// as written: a question that differs only there is a miss, while a paraphrase carrying
/// the same ones is still a hit by meaning.
#[tokio::test]
async fn words_the_embedder_reads_as_unknown_must_match_exactly() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let ask = |text: &'static str| {
        let app = &app;
        async move { cache_status(&app.chat(&chat_body(text), &[]).await) }
    };
    assert_eq!(ask("What does 🦄 mean?").await, "miss");
    assert_eq!(ask("What does 🐉 mean?").await, "miss", "another emoji");
    assert_eq!(ask("How do I reset my password? 🙂").await, "miss");
    assert_eq!(
        ask("I forgot my password, how can I change it? 🙂").await,
        "semantic",
        "a paraphrase with the same emoji"
    );
    assert_eq!(
        ask("I forgot my password, how can I change it? 😡").await,
        "miss",
        "a paraphrase with another emoji"
    );
    assert_eq!(backend.calls(), 4);
}

#[tokio::test]
async fn unrelated_prompt_is_a_miss() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    app.chat(&chat_body("How do I reset my password?"), &[])
        .await;
    let r = app
        .chat(&chat_body("What is the capital of France?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 2);
}

/// Pairs that look alike but ask different things (negation, direction, antonyms, numbers,
/// names): the embedder puts them close, only the false-hit gate tells them apart.
const TRAPS: [(&str, &str); 9] = [
    (
        "How do I cancel my subscription?",
        "How do I not cancel my subscription?",
    ),
    (
        "Can I upgrade my plan today?",
        "Can't I upgrade my plan today?",
    ),
    (
        "What is the flight time from Paris to London?",
        "What is the flight time from London to Paris?",
    ),
    (
        "How do I install the printer driver?",
        "How do I uninstall the printer driver?",
    ),
    (
        "What is the minimum order value?",
        "What is the maximum order value?",
    ),
    (
        "Is the store open on Monday?",
        "Is the store open on Tuesday?",
    ),
    (
        "Can I book a table for 4 people?",
        "Can I book a table for 6 people?",
    ),
    ("Who is the CEO of Microsoft?", "Who is the CEO of Google?"),
    (
        "How do I enable two-factor authentication?",
        "How do I disable two-factor authentication?",
    ),
];

/// With the threshold far below every trap's similarity, each trap is a candidate and the gate
/// is what refuses it: the request log names the gate's verdict. The same traps with the gate
/// off are served, so the threshold alone would not stop them.
#[tokio::test]
async fn traps_are_rejected_by_the_gate_not_the_threshold() {
    const THRESHOLD: f32 = 0.5;
    let dir = tempfile::tempdir().unwrap();
    for gate in [true, false] {
        let path = dir.path().join(format!("gate-{gate}.jsonl"));
        let mut config = semantic_config();
        config.semantic.threshold = THRESHOLD;
        config.semantic.gate = gate;
        config.log.request_log = Some(path.clone());
        let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
        for (a, b) in TRAPS {
            let ns = format!("trap-{}", a.len());
            let h = [("x-reprise-namespace", ns.as_str())];
            app.chat(&chat_body(a), &h).await;
            let r = app.chat(&chat_body(b), &h).await;
            if gate {
                assert_eq!(cache_status(&r), "miss", "trap served: {a:?} -> {b:?}");
                assert_eq!(content(r).await, format!("You asked: {b}"));
            } else {
                assert_eq!(cache_status(&r), "semantic", "{a:?} -> {b:?}");
                assert_eq!(content(r).await, format!("You asked: {a}"));
            }
        }
        let lines = || {
            std::fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap())
                .collect::<Vec<_>>()
        };
        let all = 2 * TRAPS.len();
        assert!(eventually(std::time::Duration::from_secs(5), || lines().len() == all).await);
        // One line per request, written in order (the requests ran one by one).
        let l = lines();
        for ((a, b), rec) in TRAPS.iter().zip(l.iter().skip(1).step_by(2)) {
            let sim = rec["similarity"].as_f64().unwrap_or_default();
            assert!(sim >= f64::from(THRESHOLD), "{a:?} -> {b:?}: {rec}");
            let verdict = rec["gate"].as_str().unwrap_or_default();
            if gate {
                assert_eq!(rec["outcome"], "miss", "{rec}");
                assert!(!matches!(verdict, "pass" | ""), "{a:?} -> {b:?}: {rec}");
            } else {
                assert_eq!(rec["outcome"], "semantic", "{rec}");
            }
        }
    }
}

#[tokio::test]
async fn follow_up_after_different_histories_is_a_miss() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let ada = convo(&[("user", "Who is Ada Lovelace?")]);
    let alan = convo(&[("user", "Who is Alan Turing?")]);
    let a1 = content(app.chat(&ada, &[]).await).await;
    let t1 = content(app.chat(&alan, &[]).await).await;
    let r = app
        .chat(
            &convo(&[
                ("user", "Who is Ada Lovelace?"),
                ("assistant", &a1),
                ("user", "How old was she when she died?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &convo(&[
                ("user", "Who is Alan Turing?"),
                ("assistant", &t1),
                ("user", "How old was he when he died?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "a pronoun follow-up must not match across different people"
    );
    assert_eq!(backend.calls(), 4);
}

#[tokio::test]
async fn same_history_through_a_paraphrased_first_turn_hits() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    // User 1: turn 1, answered fresh; turn 2, answered fresh.
    let q1 = "How do I reset my password?";
    let a1 = content(app.chat(&convo(&[("user", q1)]), &[]).await).await;
    let r = app
        .chat(
            &convo(&[
                ("user", q1),
                ("assistant", &a1),
                ("user", "What if I no longer have access to my email?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    let turn2 = content(r).await;
    // User 2 phrases turn 1 differently and is served the same entry.
    let q1b = "I forgot my password, how can I change it?";
    let r = app.chat(&convo(&[("user", q1b)]), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    let a1b = content(r).await;
    assert_eq!(a1b, a1);
    // Their turn 2 (paraphrased) lands in the same context: a hit.
    let r = app
        .chat(
            &convo(&[
                ("user", q1b),
                ("assistant", &a1b),
                ("user", "What if I can no longer access my email?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(content(r).await, turn2);
    assert_eq!(backend.calls(), 2);
}

/// The name an earlier answer was shown under is part of the context: the same question
/// after "Alice" answered is not the same question after "Bob" did.
#[tokio::test]
async fn an_earlier_answers_name_is_part_of_the_context() {
    let mut config = semantic_config();
    config.semantic.standalone = false;
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let ask = |name: &str| {
        json!({"model": "fake", "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "name": name, "content": "I am your assistant."},
            {"role": "user", "content": "Tell me your name, please."},
        ]})
    };
    assert_eq!(cache_status(&app.chat(&ask("Alice"), &[]).await), "miss");
    assert_eq!(cache_status(&app.chat(&ask("Alice"), &[]).await), "exact");
    assert_eq!(cache_status(&app.chat(&ask("Bob"), &[]).await), "miss");
    assert_eq!(backend.calls(), 2);
}

/// A standalone hit does not merge its conversation into the one of the question asked
/// alone: the follow-ups of each keep their own history.
#[tokio::test]
async fn a_standalone_hit_leaves_the_follow_ups_of_each_history_apart() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let q = "What is the boiling point of water at sea level?";
    let dracula = [
        ("user", "Who wrote the novel Dracula?"),
        (
            "assistant",
            "Bram Stoker wrote Dracula; it was published in 1897.",
        ),
    ];
    let e = content(app.chat(&convo(&[("user", q)]), &[]).await).await;
    let r = app
        .chat(&convo(&[dracula[0], dracula[1], ("user", q)]), &[])
        .await;
    assert_eq!(cache_status(&r), "semantic");
    let follow_up = "Who wrote it?";
    let r = app
        .chat(
            &convo(&[("user", q), ("assistant", &e), ("user", follow_up)]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &convo(&[
                dracula[0],
                dracula[1],
                ("user", q),
                ("assistant", &e),
                ("user", follow_up),
            ]),
            &[],
        )
        .await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "another history's follow-up answer"
    );
    assert_eq!(backend.calls(), 3);
}

/// A question that refers to nothing before it (and follows plain questions it is unrelated
/// to) is matched as if asked alone: across unrelated histories, in both directions. One that
/// refers back, follows a statement, or falls under a rule that turns this off keeps its
/// context.
#[tokio::test]
async fn a_standalone_question_hits_across_unrelated_histories() {
    let mut config = semantic_config();
    config.semantic.rules = vec![reprise_policies::semantic::Rule {
        namespace: Some("exact-contexts".into()),
        standalone: Some(false),
        ..Default::default()
    }];
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let boiling = "What is the boiling point of water at sea level?";
    let asked = "What's the boiling point of water at sea level?";
    let after = |history: &[(&'static str, &'static str)], q: &'static str| {
        let mut m = history.to_vec();
        m.push(("user", q));
        convo(&m)
    };
    let dracula = [
        ("user", "Who wrote the novel Dracula?"),
        (
            "assistant",
            "Bram Stoker wrote Dracula; it was published in 1897.",
        ),
    ];
    // Asked alone, then after an unrelated conversation: a hit on the lone entry.
    app.chat(&convo(&[("user", boiling)]), &[]).await;
    let r = app.chat(&after(&dracula, asked), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(content(r).await, format!("You asked: {boiling}"));
    assert_eq!(backend.calls(), 1);

    // The other way: first asked after a conversation, then alone.
    let moon = [
        ("user", "What is a good name for a golden retriever puppy?"),
        ("assistant", "Maple, Biscuit and Sunny are popular choices."),
    ];
    let r = app
        .chat(&after(&moon, "How far away is the Moon from Earth?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &convo(&[("user", "How far is the Moon from the Earth?")]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(backend.calls(), 2);

    // A follow-up that refers back keeps its context: no hit across different subjects.
    let frankenstein = [
        ("user", "Who wrote the novel Frankenstein?"),
        (
            "assistant",
            "Mary Shelley wrote Frankenstein; it was published in 1818.",
        ),
    ];
    let r = app
        .chat(&after(&dracula, "When was the author of it born?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &after(&frankenstein, "When was the author of it born?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 4);

    // After a statement (which may shape the answer) the context is kept.
    let statement = [
        ("user", "I live in Denver, a mile above sea level."),
        ("assistant", "Denver is about 1,609 metres up."),
    ];
    let r = app.chat(&after(&statement, asked), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 5);

    // A rule can keep every context exact.
    let ns = [("x-reprise-namespace", "exact-contexts")];
    app.chat(&convo(&[("user", boiling)]), &ns).await;
    let r = app.chat(&after(&dracula, asked), &ns).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 7);
}

/// System prompts and earlier messages that differ only by a paraphrase are one context; a
/// constraint that differs (another language), another answer before a "translate that", or
/// a rule asking for exact contexts keeps them apart. Follow-ups get their own threshold
/// where a rule sets one, and the gate still rejects a changed follow-up.
#[tokio::test]
async fn paraphrased_contexts_are_one_context() {
    use reprise_policies::semantic::Rule;
    let mut config = semantic_config();
    config.semantic.rules = vec![
        Rule {
            namespace: Some("exact".into()),
            context_equivalence: Some(false),
            ..Default::default()
        },
        Rule {
            namespace: Some("loose-follow-ups".into()),
            followup_threshold: Some(0.6),
            ..Default::default()
        },
    ];
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let french = "You are a helpful assistant that always answers in French.";
    let french_b = "You are a helpful assistant who always replies in French.";
    let german = "You are a helpful assistant that always answers in German.";
    let ask = |system: &'static str, q: &'static str| convo(&[("system", system), ("user", q)]);
    let (q, q_b) = (
        "What are the main causes of inflation?",
        "What is inflation mainly caused by?",
    );
    for ns in ["default", "exact"] {
        let h = [("x-reprise-namespace", ns)];
        assert_eq!(cache_status(&app.chat(&ask(french, q), &h).await), "miss");
        let r = app.chat(&ask(french_b, q_b), &h).await;
        let expected = if ns == "exact" { "miss" } else { "semantic" };
        assert_eq!(cache_status(&r), expected, "{ns}");
        assert_eq!(cache_status(&app.chat(&ask(german, q_b), &h).await), "miss");
    }
    assert_eq!(backend.calls(), 5);

    // The same poem asked for in other words, then the same transform: one context.
    let poem = "Crisp leaves drift and fall,\ngold whispers on the cold wall.";
    let other = "Rain taps on the glass,\nslow clocks let the evening pass.";
    let chat = |q1: &'static str, a1: &'static str, q2: &'static str| {
        convo(&[("user", q1), ("assistant", a1), ("user", q2)])
    };
    let ask_poem = "Write a two-line poem about autumn leaves.";
    let ask_poem_b = "Write me a short two-line poem about the leaves in autumn.";
    let translate = "Translate that into French.";
    for ns in ["default", "loose-follow-ups"] {
        let h = [("x-reprise-namespace", ns)];
        let first = app.chat(&chat(ask_poem, poem, translate), &h).await;
        assert_eq!(cache_status(&first), "miss");
        let stored = content(first).await;
        let r = app.chat(&chat(ask_poem_b, poem, translate), &h).await;
        assert_eq!(cache_status(&r), "semantic", "{ns}");
        assert_eq!(content(r).await, stored);
        // Another poem before it: another context.
        let r = app.chat(&chat(ask_poem_b, other, translate), &h).await;
        assert_eq!(cache_status(&r), "miss", "{ns}");
        // A changed follow-up in the same context: the gate.
        let r = app
            .chat(&chat(ask_poem_b, poem, "Translate that into German."), &h)
            .await;
        assert_eq!(cache_status(&r), "miss", "{ns}");
    }
    // A differently worded follow-up (cosine about 0.71): served only where follow-ups have
    // a threshold of their own.
    for (ns, expected) in [("default", "miss"), ("loose-follow-ups", "semantic")] {
        let h = [("x-reprise-namespace", ns)];
        app.chat(&chat(ask_poem, poem, "Summarize that in one line."), &h)
            .await;
        let r = app
            .chat(
                &chat(ask_poem_b, poem, "Give me a one-line summary of that."),
                &h,
            )
            .await;
        assert_eq!(cache_status(&r), expected, "{ns}");
    }
}

#[tokio::test]
async fn different_system_prompt_is_a_miss() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    app.chat(
        &convo(&[
            ("system", "You are a pirate."),
            ("user", "How do I reset my password?"),
        ]),
        &[],
    )
    .await;
    let r = app
        .chat(
            &convo(&[
                ("system", "You are a lawyer."),
                ("user", "How can I reset my password?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &convo(&[
                ("system", "You are a pirate."),
                ("user", "How can I reset my password?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(backend.calls(), 2);
}

#[tokio::test]
async fn namespaces_and_parameters_isolate_semantic_hits() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    app.chat(
        &chat_body("How do I reset my password?"),
        &[("x-reprise-namespace", "a")],
    )
    .await;
    let para = chat_body("How can I reset my password?");
    let r = app.chat(&para, &[("x-reprise-namespace", "b")]).await;
    assert_eq!(cache_status(&r), "miss");
    let mut hot = para.clone();
    hot["temperature"] = json!(1.5);
    let r = app.chat(&hot, &[("x-reprise-namespace", "a")]).await;
    assert_eq!(cache_status(&r), "miss", "other sampling parameters");
    let r = app.chat(&para, &[("x-reprise-namespace", "a")]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(backend.calls(), 3);
}

#[tokio::test]
async fn threshold_header_raises_but_never_lowers() {
    let mut config = semantic_config();
    config.semantic.threshold = 0.86;
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    app.chat(&chat_body("How do I reset my password?"), &[])
        .await;
    let para = chat_body("I forgot my password, how can I change it?");
    // Raised above the pair's similarity (about 0.89): no hit.
    let r = app.chat(&para, &[("x-reprise-threshold", "0.99")]).await;
    assert_eq!(cache_status(&r), "miss");
    // Lowering is ignored: an unrelated prompt does not hit even with threshold 0.1.
    let r = app
        .chat(
            &chat_body("How do I bake sourdough bread?"),
            &[("x-reprise-threshold", "0.1")],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    // The configured threshold still applies when the header asks for less.
    let r = app
        .chat(
            &chat_body("how can i reset my password"),
            &[("x-reprise-threshold", "0.5")],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
}

#[tokio::test]
async fn max_age_keeps_older_answers_from_being_served() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let question = chat_body("How do I reset my password?");
    app.chat(&question, &[]).await;
    let para = chat_body("I forgot my password, how can I change it?");
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    // The stored answer is a few milliseconds old: too old for max-age=0, by meaning too.
    let r = app.chat(&para, &[("cache-control", "max-age=0")]).await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(&question, &[("cache-control", "max-age=3600")])
        .await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(backend.calls(), 2);
    // Too large to represent counts as 2^31 seconds (RFC 9111), not as an error.
    let huge = [("cache-control", "max-age=99999999999999999999999")];
    assert_eq!(cache_status(&app.chat(&question, &huge).await), "exact");
    // A fresher paraphrase may answer a question whose own answer is too old, but it does
    // not take the question's key: without max-age the question gets its own answer.
    // (Two seconds apart: the fresh answer stays younger than max-age even on a slow machine.)
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    let r = app.chat(&para, &[("cache-control", "no-cache")]).await;
    assert_eq!(cache_status(&r), "miss");
    let r = app.chat(&question, &[("cache-control", "max-age=2")]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(
        content(r).await,
        "You asked: I forgot my password, how can I change it?"
    );
    let r = app.chat(&question, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(content(r).await, "You asked: How do I reset my password?");
    assert_eq!(backend.calls(), 3);
    let r = app
        .chat(&question, &[("cache-control", "max-age=soon")])
        .await;
    assert_eq!(r.status(), 400);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["error"]["param"], "cache-control", "{j}");
}

#[tokio::test]
async fn only_if_cached_never_calls_the_backend() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let r = app
        .chat(
            &chat_body("How do I reset my password?"),
            &[("cache-control", "only-if-cached")],
        )
        .await;
    assert_eq!(r.status(), 504);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["error"]["code"], "not_cached");
    assert_eq!(backend.calls(), 0);
    app.chat(&chat_body("How do I reset my password?"), &[])
        .await;
    let r = app
        .chat(
            &chat_body("How can I reset my password?"),
            &[("cache-control", "only-if-cached")],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn request_log_records_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut config = semantic_config();
    config.log.request_log = Some(path.clone());
    const FIRST_TOKEN: std::time::Duration = std::time::Duration::from_millis(50);
    const TOKEN: std::time::Duration = std::time::Duration::from_millis(10);
    let script = ScriptConfig {
        first_token_delay: FIRST_TOKEN,
        token_delay: TOKEN,
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    app.chat(
        &chat_body("How do I reset my password?"),
        &[("x-reprise-namespace", "logged")],
    )
    .await;
    app.chat(
        &chat_body("How can I reset my password?"),
        &[("x-reprise-namespace", "logged")],
    )
    .await;
    app.chat(
        &chat_body("How do I not reset my password?"),
        &[("x-reprise-namespace", "logged")],
    )
    .await;
    let lines = || {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    assert!(eventually(std::time::Duration::from_secs(5), || lines().len() == 3).await);
    let l = lines();
    assert_eq!(l[0]["outcome"], "miss");
    assert_eq!(l[0]["namespace"], "logged");
    assert!(l[0]["embed_ms"].as_f64().is_some());
    assert!(l[0]["backend_ms"].as_f64().is_some());
    assert_eq!(l[1]["outcome"], "semantic");
    assert_eq!(l[1]["gate"], "pass");
    assert!(l[1]["similarity"].as_f64().unwrap() > 0.86);
    assert!(l[1]["entry_id"].as_str().is_some());
    assert!(l[1]["search_ms"].as_f64().is_some());
    assert_eq!(l[2]["outcome"], "miss");
    assert_eq!(l[2]["gate"], "negation", "{}", l[2]);
    for rec in &l {
        // The whole request contains the steps it logs: lookup, then (a miss) the wait for the
        // backend's first token.
        let total = rec["total_ms"].as_f64().unwrap();
        let parts = ["embed_ms", "search_ms"]
            .iter()
            .filter_map(|k| rec[*k].as_f64())
            .sum::<f64>();
        assert!(total >= parts, "{rec}");
        if let Some(first_token) = rec["backend_ms"].as_f64() {
            assert!(first_token >= parts, "{rec}");
            assert!(total >= first_token, "{rec}");
        }
        assert!(rec["time_ms"].as_u64().unwrap() > 0);
    }
    // The miss waited for every scripted token (sleeps are never shorter than asked): at least
    // the first token's delay plus one delay per further word of "You asked: How do I reset
    // my password?" (7 words).
    let waited = (FIRST_TOKEN + 6 * TOKEN).as_secs_f64() * 1000.0;
    assert!(l[0]["backend_ms"].as_f64().unwrap() >= FIRST_TOKEN.as_secs_f64() * 1000.0);
    assert!(l[0]["total_ms"].as_f64().unwrap() >= waited, "{}", l[0]);
}

#[tokio::test]
async fn paraphrase_waits_for_its_twin_in_flight() {
    let script = ScriptConfig {
        token_delay: std::time::Duration::from_millis(40),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(semantic_config(), script).await;
    let app = std::sync::Arc::new(app);
    let first = {
        let app = app.clone();
        tokio::spawn(async move {
            app.chat(&chat_body("How do I reset my password?"), &[])
                .await
        })
    };
    // Let the first request start generating.
    assert!(eventually(std::time::Duration::from_secs(5), || backend.calls() == 1).await);
    let mut body = chat_body("I forgot my password, how can I change it?");
    body["stream"] = json!(true);
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert!(r.headers().get("x-reprise-similarity").is_some());
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "You asked: How do I reset my password?");
    let r = first.await.unwrap();
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 1, "the paraphrase did not generate again");
    // A trap arriving while its look-alike generates does not wait for it.
    let slow = {
        let app = app.clone();
        tokio::spawn(async move {
            app.chat(&chat_body("How do I enable dark mode?"), &[])
                .await
        })
    };
    assert!(eventually(std::time::Duration::from_secs(5), || backend.calls() == 2).await);
    let r = app
        .chat(&chat_body("How do I disable dark mode?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(content(r).await, "You asked: How do I disable dark mode?");
    slow.await.unwrap();
    assert_eq!(backend.calls(), 3);
}

#[tokio::test]
async fn snapshot_keeps_exact_and_semantic_hits_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.snapshot");
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    app.chat(&chat_body("How do I reset my password?"), &[])
        .await;
    app.chat(&chat_body("What is the capital of France?"), &[])
        .await;
    let saved = reprise::snapshot::save(&app.state, &path).unwrap();
    assert_eq!(saved.entries, 2);
    drop(app);

    let (app2, backend2) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let loaded = reprise::snapshot::load(&app2.state, &path).await.unwrap();
    assert_eq!(loaded.entries, 2);
    assert!(loaded.keys >= 2);
    let r = app2
        .chat(&chat_body("What is the capital of France?"), &[])
        .await;
    assert_eq!(cache_status(&r), "exact");
    let r = app2
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(
        cache_status(&r),
        "semantic",
        "the index was rebuilt from the snapshot"
    );
    assert_eq!(content(r).await, "You asked: How do I reset my password?");
    assert_eq!(backend.calls(), 2);
    assert_eq!(backend2.calls(), 0);

    // A corrupt snapshot is ignored, never fatal.
    std::fs::write(&path, "garbage\n{not json").unwrap();
    let (app3, _b) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let loaded = reprise::snapshot::load(&app3.state, &path).await.unwrap();
    assert_eq!(loaded.entries, 0);
}

#[tokio::test]
async fn substituted_words_far_apart_in_meaning_are_not_served() {
    let mut config = semantic_config();
    config.semantic.substitution_threshold = 0.6;
    config.semantic.threshold = 0.8;
    let script = ScriptConfig {
        token_delay: std::time::Duration::from_millis(40),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let app = std::sync::Arc::new(app);
    app.chat(&chat_body("What does my home insurance cover?"), &[])
        .await;
    let r = app
        .chat(&chat_body("What does my car insurance cover?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss", "home vs car insurance");
    app.chat(&chat_body("Which shop sells stamps?"), &[]).await;
    let r = app.chat(&chat_body("Which store sells stamps?"), &[]).await;
    assert_eq!(
        cache_status(&r),
        "semantic",
        "shop vs store is the same question"
    );
    assert_eq!(backend.calls(), 3);

    // Nor does a question wait for such a look-alike being generated.
    let ns = [("x-reprise-namespace", "in-flight")];
    let home = {
        let app = app.clone();
        tokio::spawn(async move {
            app.chat(&chat_body("What does my home insurance cover?"), &ns)
                .await
        })
    };
    assert!(eventually(std::time::Duration::from_secs(5), || backend.calls() == 4).await);
    let r = app
        .chat(&chat_body("What does my car insurance cover?"), &ns)
        .await;
    assert_eq!(cache_status(&r), "miss", "home vs car insurance in flight");
    assert_eq!(
        content(r).await,
        "You asked: What does my car insurance cover?"
    );
    assert_eq!(cache_status(&home.await.unwrap()), "miss");
    assert_eq!(backend.calls(), 5);
}

async fn feedback(app: &TestApp, body: Value, key: Option<&str>) -> reqwest::Response {
    let mut req = app.client.post(app.url("/v1/feedback")).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap()
}

/// An entry wrong for more questions than it can keep refusing is deleted by the next
/// wrong verdict (its own question is then answered afresh).
#[tokio::test]
async fn an_entry_refused_too_often_is_deleted() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let first = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    let id: reprise_cache::EntryId = header(&first, "x-reprise-entry").unwrap().parse().unwrap();
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    let response = r.json::<Value>().await.unwrap()["id"].clone();
    // Wrong for as many other questions as it keeps.
    let store = &app.state.store;
    let mut full = (*store.get(id).await.unwrap()).clone();
    let mut n = 0u32;
    while !full.refusals_full() {
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(&n.to_le_bytes());
        full.refuse(reprise_cache::entry::Refusal { key, around: None });
        n += 1;
    }
    store.update(std::sync::Arc::new(full)).await;
    let said = feedback(&app, json!({"id": response, "verdict": "wrong"}), None).await;
    assert_eq!(said.status(), 200);
    assert_eq!(said.json::<Value>().await.unwrap()["refused"], true);
    assert!(store.get_kept(id).await.unwrap().is_none(), "deleted");
    let calls = backend.calls();
    let again = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&again), "miss");
    assert_eq!(backend.calls(), calls + 1);
}

/// A full memory of responses forgets the oldest, never the newest: a verdict on the last
/// answer of many is taken.
#[tokio::test]
async fn a_full_response_memory_keeps_the_newest_responses() {
    let mut config = test_config();
    config.feedback.memory_bytes = 8 * 1024;
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let mut ids = Vec::new();
    for i in 0..80 {
        let r = app
            .chat(&chat_body(&format!("Question number {i}?")), &[])
            .await;
        assert_eq!(r.status(), 200);
        ids.push(
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    app.state.responses.run_pending_tasks();
    let last = ids.pop().unwrap();
    let said = feedback(&app, json!({"id": last, "verdict": "right"}), None).await;
    assert_eq!(said.status(), 200, "the newest response is remembered");
    let first = ids.remove(0);
    let said = feedback(&app, json!({"id": first, "verdict": "right"}), None).await;
    assert_eq!(said.status(), 404, "the oldest is forgotten");
}

/// A verdict given over HTTP is a line of the request log, which `reprise tune --log` joins
/// to the hit it judges.
#[tokio::test]
async fn verdicts_reach_the_request_log_that_tune_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut config = semantic_config();
    config.log.request_log = Some(path.clone());
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    app.chat(&chat_body("How do I reset my password?"), &[])
        .await;
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let said = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(said.status(), 200);
    let lines = || std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        eventually(std::time::Duration::from_secs(5), || lines()
            .lines()
            .count()
            == 3)
        .await
    );
    let verdict: Value = serde_json::from_str(lines().lines().nth(2).unwrap()).unwrap();
    assert_eq!(verdict["outcome"], "feedback", "{verdict}");
    assert_eq!(verdict["verdict"], "wrong", "{verdict}");
    assert_eq!(verdict["id"], id.as_str(), "{verdict}");
    let filter = reprise::tune::log::Filter::default();
    let d = reprise::tune::log::read(std::slice::from_ref(&path), None, &filter).unwrap();
    assert_eq!((d.verdicts, d.served, d.judged), (1, 1, 1));
    let judged: Vec<_> = d.samples.iter().filter_map(|s| s.wrong).collect();
    assert_eq!(judged, [true]);
    // Counted under the anonymous tenant's name, as its requests are (an empty label is no
    // label to Prometheus).
    let m = app.metrics_text().await;
    let anonymous = [
        ("tenant", "anonymous"),
        ("verdict", "wrong"),
        ("outcome", "semantic"),
    ];
    assert!(
        sample(&m, "reprise_feedback_total", &anonymous).is_some_and(|n| n >= 1.0),
        "{m}"
    );
    assert!(!m.contains("tenant=\"\""), "{m}");
}

/// A semantic hit reported wrong is never served again to that question or to questions
/// around it, while its entry still answers its own question; verdicts name responses of the
/// caller's tenant only, and bad ones are refused in the OpenAI error shape.
#[tokio::test]
async fn a_hit_reported_wrong_is_not_served_to_that_question_again() {
    let mut config = semantic_config();
    let doc = "[[tenants]]\nname = \"a\"\napi_keys = [\"sk-a\"]\n\
               [[tenants]]\nname = \"b\"\napi_keys = [\"sk-b\"]\n";
    config.auth.required = true;
    config.tenants = reprise::policy::PolicyDocument::from_toml(doc)
        .unwrap()
        .tenants
        .unwrap();
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let auth = [("authorization", "Bearer sk-a")];
    let original = chat_body("How do I reset my password?");
    assert_eq!(cache_status(&app.chat(&original, &auth).await), "miss");
    let asked = chat_body("I forgot my password, how can I change it?");
    let r = app.chat(&asked, &auth).await;
    assert_eq!(cache_status(&r), "semantic");
    let entry = r.headers()["x-reprise-entry"].to_str().unwrap().to_string();
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The exact repeat was linked to the entry: an exact hit, with its own id.
    let r = app.chat(&asked, &auth).await;
    assert_eq!(cache_status(&r), "exact");
    let repeat_id = r.json::<Value>().await.unwrap()["id"].clone();
    assert_ne!(repeat_id, json!(id), "every response has its own id");

    // Bad verdicts change nothing.
    let bad = feedback(&app, json!({"id": id, "verdict": "meh"}), Some("sk-a")).await;
    assert_openai_error(bad, 400, Some("verdict")).await;
    let unknown = feedback(
        &app,
        json!({"id": "chatcmpl-x", "verdict": "wrong"}),
        Some("sk-a"),
    )
    .await;
    assert_openai_error(unknown, 404, Some("id")).await;
    let other = feedback(&app, json!({"id": id, "verdict": "wrong"}), Some("sk-b")).await;
    assert_openai_error(other, 404, Some("id")).await;
    assert_eq!(
        feedback(&app, json!({"id": id, "verdict": "wrong"}), None)
            .await
            .status(),
        401
    );
    assert_eq!(cache_status(&app.chat(&asked, &auth).await), "exact");
    // A wording almost alike, linked to the entry by its own hit: an alias of it too.
    let near = chat_body("I forgot my password, how can I change it ?");
    assert_eq!(cache_status(&app.chat(&near, &auth).await), "semantic");
    assert_eq!(cache_status(&app.chat(&near, &auth).await), "exact");

    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), Some("sk-a")).await;
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(
        (j["refused"].clone(), j["entry"].clone()),
        (json!(true), json!(entry))
    );
    // One verdict a response.
    let again = feedback(&app, json!({"id": id, "verdict": "wrong"}), Some("sk-a")).await;
    assert_openai_error(again, 404, Some("id")).await;
    // Neither the question nor one worded almost alike gets that answer again.
    let calls = backend.calls();
    let r = app.chat(&asked, &auth).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(
        content(r).await,
        "You asked: I forgot my password, how can I change it?"
    );
    let r = app.chat(&near, &auth).await;
    assert_ne!(
        content(r).await,
        "You asked: How do I reset my password?",
        "the neighbourhood of the question is refused too"
    );
    assert!(backend.calls() > calls);
    // The entry still answers its own question.
    let r = app.chat(&original, &auth).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(r.headers()["x-reprise-entry"], entry.as_str());
    // A `right` verdict is taken and changes nothing.
    let id = app
        .chat(&original, &auth)
        .await
        .json::<Value>()
        .await
        .unwrap()["id"]
        .clone();
    let r = feedback(&app, json!({"id": id, "verdict": "right"}), Some("sk-a")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&app.chat(&original, &auth).await), "exact");
    let m = app.metrics_text().await;
    assert!(
        m.contains(r#"reprise_feedback_total{tenant="a",verdict="wrong",outcome="semantic"} 1"#),
        "{m}"
    );
}

/// An exact repeat of a paraphrase reaches the answer its hit by meaning linked: reported
/// wrong there (not only on the first hit), the link is refused all the same, while the
/// entry still answers its own question and its own exact repeat.
#[tokio::test]
async fn a_wrong_verdict_on_a_linked_exact_repeat_refuses_it() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let original = chat_body("How do I reset my password?");
    assert_eq!(cache_status(&app.chat(&original, &[]).await), "miss");
    let asked = chat_body("I forgot my password, how can I change it?");
    assert_eq!(cache_status(&app.chat(&asked, &[]).await), "semantic");
    let r = app.chat(&asked, &[]).await;
    assert_eq!(cache_status(&r), "exact", "linked by the hit by meaning");
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["refused"], json!(true));
    let calls = backend.calls();
    let r = app.chat(&asked, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(
        content(r).await,
        "You asked: I forgot my password, how can I change it?"
    );
    assert_eq!(backend.calls(), calls + 1);
    // A verdict on the entry's own question, exact, refuses nothing.
    let r = app.chat(&original, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.json::<Value>().await.unwrap()["refused"], json!(false));
    assert_eq!(cache_status(&app.chat(&original, &[]).await), "exact");
}

/// Under `semantic.delta` the threshold is learned: a hit reported wrong raises it above the
/// similarity it was served at, and near misses whose answers turn out the same lower it,
/// down to where they were seen.
#[tokio::test]
async fn learned_thresholds_tighten_after_wrong_verdicts_and_loosen_after_right_ones() {
    // Every password question gets the same answer: near misses are right.
    let script = ScriptConfig {
        rules: vec![(
            "password".into(),
            "Open Settings, then Security, then Reset password.".into(),
        )],
        ..ScriptConfig::default()
    };
    let mut config = semantic_config();
    config.semantic.delta = 0.05;
    config.semantic.min_threshold = 0.5;
    config.semantic.verify_near_misses = 1.0;
    let (app, _backend) = spawn_fake(config.clone(), script.clone()).await;
    let learned = |app: &TestApp, delta: f64, configured: f32| {
        app.state
            .bounds
            .threshold("", "*/*", delta, configured, 0.5)
    };
    assert_eq!(learned(&app, 0.05, 0.86).threshold, 0.86, "no verdicts yet");
    assert_eq!(
        cache_status(
            &app.chat(&chat_body("How do I reset my password?"), &[])
                .await
        ),
        "miss"
    );
    // A client's own threshold raises what it is served at, not what the scope shows.
    let strict = [
        ("x-reprise-threshold", "0.99"),
        ("cache-control", "only-if-cached"),
    ];
    app.chat(&chat_body("Where do I reset my password?"), &strict)
        .await;
    let m = app.metrics_text().await;
    let series = [("tenant", "anonymous"), ("scope", "*/*")];
    let gauge = sample(&m, "reprise_semantic_threshold", &series);
    assert_eq!(gauge, Some(f64::from(0.86f32)), "{m}");
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    let sim: f32 = r.headers()["x-reprise-similarity"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 200);
    let after = learned(&app, 0.05, 0.86);
    assert!(
        after.threshold > sim && after.threshold > 0.86,
        "{after:?} vs {sim}"
    );
    // What the next lookup uses is what the metrics show, for the tenant and the scope: no
    // verdict at or above the raised threshold, so the upper bound is 1.
    app.chat(&chat_body("Where can I change my password?"), &[])
        .await;
    let m = app.metrics_text().await;
    let gauge = sample(&m, "reprise_semantic_threshold", &series);
    assert_eq!(gauge, Some(f64::from(after.threshold)), "{m}");
    let share = |m: &str, estimate| {
        let mut labels = series.to_vec();
        labels.push(("estimate", estimate));
        sample(m, "reprise_semantic_wrong_share", &labels)
    };
    assert_eq!(
        (
            share(&m, "observed"),
            share(&m, "lower"),
            share(&m, "upper")
        ),
        (Some(0.0), Some(0.0), Some(1.0)),
        "{m}"
    );
    let used = sample(
        &m,
        "reprise_semantic_threshold_used_count",
        &[("tenant", "anonymous")],
    );
    assert!(used.is_some_and(|n| n >= 3.0), "{m}");

    // Another server, strict (0.97) under a looser bound: near misses teach it. Its rule
    // for namespace `legal` (0.99) is a scope of its own.
    config.semantic.threshold = 0.97;
    config.semantic.delta = 0.3;
    config.semantic.rules = vec![reprise_policies::semantic::Rule {
        namespace: Some("legal".into()),
        threshold: Some(0.99),
        ..Default::default()
    }];
    let (app, _backend) = spawn_fake(config, script).await;
    assert_eq!(
        cache_status(
            &app.chat(&chat_body("How do I reset my password?"), &[])
                .await
        ),
        "miss"
    );
    let asks = [
        "How can I change",
        "I need to reset",
        "Help me recover",
        "Where do I update",
        "What if I forgot",
        "Can you reset",
    ];
    let ends = [
        "?",
        " please?",
        " today?",
        " on my phone?",
        " for my work account?",
    ];
    let mut served = Vec::new();
    for a in asks {
        for e in ends {
            let r = app
                .chat(&chat_body(&format!("{a} my password{e}")), &[])
                .await;
            let sim = r
                .headers()
                .get("x-reprise-similarity")
                .map(|v| v.to_str().unwrap().parse::<f32>().unwrap());
            served.push((cache_status(&r), sim));
        }
    }
    let state = app.state.clone();
    let loosened = eventually(std::time::Duration::from_secs(10), || {
        let l = state.bounds.threshold("", "*/*", 0.3, 0.97, 0.5);
        l.learned && l.threshold < 0.97
    })
    .await;
    assert!(loosened, "{:?} after {served:?}", learned(&app, 0.3, 0.97));
    let l = learned(&app, 0.3, 0.97);
    assert!(l.threshold >= 0.5 && l.wrong_upper <= 0.3, "{l:?}");
    app.chat(&chat_body("Could you reset my password?"), &[])
        .await;
    let m = app.metrics_text().await;
    let gauge = sample(&m, "reprise_semantic_threshold", &series).unwrap();
    assert!(gauge < 0.97, "{m}");
    let upper = share(&m, "upper").unwrap();
    assert!(upper <= 0.3, "{m}");
    // The looser threshold is the one served at: later wordings were hits below 0.97.
    assert!(
        served
            .iter()
            .any(|(s, sim)| s == "semantic" && sim.is_some_and(|x| x < 0.97)),
        "{served:?}"
    );
    // Those verdicts were taken under the default threshold: the `legal` rule keeps its own
    // (no verdicts there yet), so a wording served loosely above is not served in `legal`
    // below 0.99. (Its own near misses then teach `legal` in turn.)
    let legal = state.bounds.threshold("", "legal/*", 0.3, 0.99, 0.5);
    assert_eq!((legal.threshold, legal.learned), (0.99, false), "{legal:?}");
    let ns = [("x-reprise-namespace", "legal")];
    let original = chat_body("How do I reset my password?");
    assert_eq!(cache_status(&app.chat(&original, &ns).await), "miss");
    expect_status(&app, &original, &ns, "exact").await;
    let first = chat_body("How can I change my password?");
    let r = app.chat(&first, &ns).await;
    assert_ne!(
        cache_status(&r),
        "semantic",
        "served in legal below its threshold"
    );
}

/// Text of about `bytes` bytes, for long prompts: words every rule of the false-hit gate
/// looks at (prefixed words, antonyms, capitalised names), none that differ between sides.
fn filler(bytes: usize) -> String {
    let sentence = "Then the Madrid routers disconnect, the Oslo accounts deactivate and the \
                    team uploads its reports to the Lisbon archive before anyone can unlock it. ";
    sentence.repeat(bytes / sentence.len())
}

/// A prompt of megabytes whose start matches a stored one (same long text, another name at
/// the start) is judged by the false-hit gate over a bounded start, off the async workers:
/// while two of them are looked up and wait for the backend, exact hits and /healthz are
/// answered on a server with two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megabyte_prompts_like_a_stored_one_leave_exact_hits_answering() {
    let script = ScriptConfig {
        reply: "noted".into(),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(semantic_config(), script.clone()).await;
    // Under the default 4 MiB body limit with the JSON around it.
    let long = filler(4_000_000);
    let prompt = |name: &str| format!("Can we move the {name} office to the new building? {long}");
    let stored = prompt("Berlin");
    assert!(chat_body(&stored).to_string().len() < 4 * 1024 * 1024);
    let r = app.chat(&chat_body(&stored), &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    let small = chat_body("What are your opening hours?");
    assert_eq!(cache_status(&app.chat(&small, &[]).await), "miss");
    let before = backend.calls();
    assert_eq!(before, 2);

    // The hostile requests reach the backend and wait there.
    backend.set_config(ScriptConfig {
        first_token_delay: std::time::Duration::from_secs(3600),
        ..script
    });
    let hostile: Vec<_> = ["Paris", "Rome"]
        .into_iter()
        .map(|name| {
            let (client, url, body) =
                (app.client.clone(), app.chat_url(), chat_body(&prompt(name)));
            tokio::spawn(async move { client.post(url).json(&body).send().await })
        })
        .collect();
    // Exact hits and /healthz, until both hostile requests are past their lookups (the
    // gate rejected the stored prompt: another name) and in the backend.
    let mut answered = 0;
    loop {
        let r = app.chat(&small, &[]).await;
        assert_eq!(cache_status(&r), "exact");
        assert_eq!(app.get("/healthz").await.status(), 200);
        answered += 1;
        if backend.calls() == before + 2 {
            break;
        }
    }
    assert!(
        answered > 0,
        "{answered} exact hits while they were in flight"
    );
    assert!(
        hostile.iter().all(|h| !h.is_finished()),
        "the hostile requests are still in flight"
    );
    for h in hostile {
        h.abort();
    }
}

/// A handbook excerpt of about 300 tokens: longer than the embedder reads (254 tokens of
/// text), so a question after it lies beyond what is embedded.
const HANDBOOK: &str = "Please read this section of the staff handbook carefully before you \
    answer. Every member of staff is expected to keep their personal details up to date in the \
    people system, including their home address, emergency contact and bank account, because \
    payroll and benefits are calculated from those records. Requests for leave should be made \
    through the same system as early as possible, and your line manager will review them in \
    the order they arrive, taking into account the needs of the team and any busy periods that \
    have been announced in advance. If you are unwell, tell your manager before the start of \
    your working day and keep them informed about when you expect to return; a medical note is \
    needed for longer absences. Expenses must be claimed with receipts attached, and claims are \
    paid with the next salary run once they have been approved. Equipment such as laptops and \
    phones remains the property of the company and must be returned when you leave, together \
    with any access badges and keys. Training courses are offered throughout the year, and you \
    are encouraged to discuss your development with your manager during regular check-ins. \
    Concerns about conduct, safety or wellbeing can be raised confidentially with the people \
    team at any time, and they will be handled promptly, fairly and with discretion, and \
    nobody who raises a concern in good faith will be treated unfairly as a result of it.";

/// The embedder reads the first 256 tokens of a question; what follows must match exactly.
/// Two questions after the same long context never share an answer; the same long prompt is
/// an exact hit; a long prompt reworded only where it is read still matches by meaning, as
/// short paraphrases do.
#[tokio::test]
async fn text_beyond_what_the_embedder_reads_never_aliases() {
    let (app, backend) = spawn_fake(semantic_config(), ScriptConfig::default()).await;
    let ask = |question: &str| format!("{HANDBOOK}\n\nQuestion: {question}");
    let first = ask("What is the notice period for resigning?");
    let (read, _) = embedder().split(&first);
    assert!(
        !read.contains("Question:"),
        "the question lies beyond what the embedder reads"
    );

    let r = app.chat(&chat_body(&first), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let second = ask("Who approves expense claims?");
    let r = app.chat(&chat_body(&second), &[]).await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "another question after the same context"
    );
    assert_eq!(content(r).await, format!("You asked: {second}"));
    let r = app.chat(&chat_body(&first), &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(content(r).await, format!("You asked: {first}"));
    assert_eq!(backend.calls(), 2);

    // Reworded where it is read (one word for another of one token), the same end.
    let reworded = first.replacen("Please read", "Kindly read", 1);
    let r = app.chat(&chat_body(&reworded), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(content(r).await, format!("You asked: {first}"));

    app.chat(&chat_body("How do I reset my password?"), &[])
        .await;
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(backend.calls(), 3);
}

/// The judge prompt (`verify_judge = "prompt"`) asks the backend with none of the client's
/// settings (its stop strings, penalties and extra fields would garble the one word), and
/// its one-word answer is a verdict.
#[tokio::test]
async fn the_judge_prompt_carries_none_of_the_clients_settings() {
    let script = ScriptConfig {
        rules: vec![("You judge answers".into(), "yes".into())],
        ..ScriptConfig::default()
    };
    let mut config = semantic_config();
    config.semantic.verify_hits = 1.0;
    config.semantic.verify_judge = reprise::config::VerifyJudge::Prompt;
    let (app, backend) = spawn_fake(config, script).await;
    let ask = |text: &str| {
        let mut b = chat_body(text);
        b["max_tokens"] = 100.into();
        b["stop"] = json!(["yes"]);
        b["presence_penalty"] = json!(1.5);
        b["response_format"] = json!({"type": "json_object"});
        b
    };
    app.chat(&ask("How do I reset my password?"), &[]).await;
    let r = app
        .chat(&ask("I forgot my password, how can I change it?"), &[])
        .await;
    assert_eq!(cache_status(&r), "semantic");
    let b = backend.clone();
    assert!(eventually(std::time::Duration::from_secs(10), || b.calls() == 3).await);
    let judge = backend
        .requests()
        .into_iter()
        .find(|r| format!("{:?}", r.input).contains("You judge answers"))
        .expect("the judge was asked");
    assert_eq!(judge.params.max_tokens, Some(4));
    assert!(judge.params.stop.is_empty(), "{:?}", judge.params);
    assert_eq!(judge.params.presence_penalty, None);
    assert!(judge.extra.is_empty(), "{:?}", judge.extra);
    // Its "yes" is a verdict: the hit was right.
    let state = app.state.clone();
    let judged = eventually(std::time::Duration::from_secs(10), || {
        state.bounds.threshold("", "*/*", 0.02, 0.0, 0.0).verdicts >= 1.0
    });
    assert!(judged.await);
}

/// A paraphrase served from the cache with every hit checked by the judge prompt (which says
/// "yes", right) after a second's generation; returns the app and the response's id.
async fn checked_hit(feedback_on: bool) -> (TestApp, Value) {
    let script = ScriptConfig {
        rules: vec![("You judge answers".into(), "yes".into())],
        first_token_delay: std::time::Duration::from_secs(2),
        ..ScriptConfig::default()
    };
    let mut config = semantic_config();
    config.semantic.verify_hits = 1.0;
    config.semantic.verify_judge = reprise::config::VerifyJudge::Prompt;
    config.feedback.enabled = feedback_on;
    let (app, _backend) = spawn_fake(config, script).await;
    let ask = |text: &str| {
        let mut b = chat_body(text);
        b["max_tokens"] = 100.into();
        b
    };
    app.chat(&ask("How do I reset my password?"), &[]).await;
    let r = app
        .chat(&ask("I forgot my password, how can I change it?"), &[])
        .await;
    assert_eq!(cache_status(&r), "semantic");
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    (app, id)
}

/// Verdicts counted as evidence for the anonymous tenant's default scope.
fn evidence(app: &TestApp) -> f64 {
    app.state
        .bounds
        .threshold("", "*/*", 0.02, 0.0, 0.0)
        .verdicts
}

/// One hit is one verdict of evidence, the first given: a check's verdict and a client's on
/// the same response count once, in either order, and the later one still acts (a client's
/// `wrong` refuses the entry for that question).
#[tokio::test]
async fn a_check_and_a_clients_verdict_on_one_hit_count_once() {
    // The check first: counted; the client's verdict then refuses but adds nothing.
    let (app, id) = checked_hit(true).await;
    assert!(eventually(std::time::Duration::from_secs(20), || evidence(&app) >= 1.0).await);
    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["refused"], true);
    assert_eq!(evidence(&app), 1.0);

    // The client first (the check's generations take seconds): counted; the check that
    // ends after it is superseded and adds nothing.
    let (app, id) = checked_hit(true).await;
    let superseded = || verify_checks(&app, "superseded");
    let before = superseded().await;
    let r = feedback(&app, json!({"id": id, "verdict": "right"}), None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(evidence(&app), 1.0);
    let ended = eventually_async(std::time::Duration::from_secs(20), || async {
        superseded().await > before
    });
    assert!(ended.await, "the check ended superseded");
    assert_eq!(evidence(&app), 1.0);
    // A second verdict on it is unknown.
    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 404);

    // Without feedback no client's verdict can come: every check counts.
    let (app, _) = checked_hit(false).await;
    assert!(eventually(std::time::Duration::from_secs(20), || evidence(&app) >= 1.0).await);
}

/// Sampled checks of hits run in the background, one at a time and within their token budget,
/// never holding up the answer; a check that finds the cached answer wrong refuses it.
#[tokio::test]
async fn hits_are_checked_in_the_background_within_a_budget() {
    // Generations take seconds, so a check is still running while the next hits come.
    let script = ScriptConfig {
        first_token_delay: std::time::Duration::from_secs(2),
        ..ScriptConfig::default()
    };
    let mut config = semantic_config();
    config.semantic.verify_hits = 1.0;
    // Two checks of 300 tokens a minute.
    config.semantic.verify_tokens_per_minute = 600;
    let (app, backend) = spawn_fake(config, script).await;
    let ask = |text: &str| {
        let mut b = chat_body(text);
        b["max_tokens"] = 300.into();
        b
    };
    assert_eq!(
        cache_status(&app.chat(&ask("How do I reset my password?"), &[]).await),
        "miss"
    );
    assert_eq!(backend.calls(), 1);
    let first = ask("I forgot my password, how can I change it?");
    let r = app.chat(&first, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    // Answered before its check generated anything (its first token takes seconds).
    assert_eq!(backend.completed(), 1);
    let b = backend.clone();
    assert!(eventually(std::time::Duration::from_secs(10), || b.calls() == 2).await);
    // Another hit while that check runs: skipped, not queued.
    let r = app.chat(&ask("How can I reset my password?"), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(backend.calls(), 2);
    // The check judged the cached answer wrong for that question (the scripted backend names
    // the prompt in its answer): it is refused from now on.
    let b = backend.clone();
    assert!(eventually(std::time::Duration::from_secs(10), || b.active() == 0).await);
    let app_ref = &app;
    let refused = eventually_async(std::time::Duration::from_secs(10), || async {
        app_ref
            .state
            .store
            .entries()
            .iter()
            .any(|e| !e.refusals.is_empty())
    })
    .await;
    assert!(refused);
    let r = app.chat(&first, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    // One more check fits the budget; after it, none.
    let calls = backend.calls();
    let (mut misses, mut hits) = (0, 0);
    for text in [
        "I need to reset my password, how?",
        "Could you help me reset my password?",
        "Please help me reset my password",
        "What are the steps to reset my password?",
        "How would I reset my password?",
    ] {
        match cache_status(&app.chat(&ask(text), &[]).await).as_str() {
            "miss" => misses += 1,
            "semantic" => hits += 1,
            other => panic!("{other}"),
        }
        let b = backend.clone();
        assert!(eventually(std::time::Duration::from_secs(10), || b.active() == 0).await);
    }
    assert!(hits >= 2, "{hits} hits");
    assert_eq!(
        backend.calls(),
        calls + misses + 1,
        "one check, then the budget is spent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_embedder_queue_is_a_429_with_retry_after_that_changes_nothing() {
    let mut config = semantic_config();
    let dir = models_dir();
    config.semantic.model_dir = dir.join("all-MiniLM-L6-v2");
    config.semantic.onnx_runtime = dir.join("libonnxruntime.so");
    // Room for one prompt, no waiting for more, and a first round held open while the other
    // requests arrive.
    config.semantic.embedder_queue_texts = 1;
    config.semantic.embedder_queue_wait_ms = 0;
    config.semantic.batch_wait_us = 300_000;
    let embedder = load_embedder(&config).await.unwrap();
    let backend = scripted();
    let app = start_app(config, std::sync::Arc::new(backend.clone()), embedder)
        .await
        .unwrap();
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Which train goes to station number {i}?"))
        .collect();
    let bodies: Vec<Value> = prompts.iter().map(|p| chat_body(p)).collect();
    let answers = futures::future::join_all(bodies.iter().map(|b| app.chat(b, &[]))).await;
    let mut refused = Vec::new();
    for (prompt, r) in prompts.iter().zip(answers) {
        if r.status() == 429 {
            assert_eq!(r.headers()["retry-after"], "1");
            let body = assert_openai_error(r, 429, None).await;
            assert_eq!(body["error"]["code"], "overloaded", "{body}");
            refused.push(prompt.clone());
        } else {
            assert_eq!(r.status(), 200);
            assert_eq!(cache_status(&r), "miss");
        }
    }
    assert!(!refused.is_empty(), "no request was refused");
    // Refused requests never reached the backend, and stored nothing: asked again (one at a
    // time, so each finds the room the one before freed), each is a miss the backend answers.
    assert_eq!(backend.calls(), 8 - refused.len());
    for p in &refused {
        let r = app.chat(&chat_body(p), &[]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(cache_status(&r), "miss");
    }
    assert_eq!(backend.calls(), 8);
}

/// A check whose reference answer stopped at its token cap gives no verdict: a cut-off
/// answer is no measure of a whole one. A check of whole answers does.
#[tokio::test]
async fn a_check_cut_off_at_its_token_cap_gives_no_verdict() {
    let mut config = semantic_config();
    config.semantic.verify_hits = 1.0;
    // The same reply whatever is asked: every check that judges finds the answer right.
    let script = ScriptConfig {
        reply: "Open the settings, choose security, then reset the password.".into(),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let verdicts = || {
        let scope = reprise_policies::semantic::scope(None);
        app.state
            .bounds
            .threshold("", &scope, 0.02, 0.86, 0.7)
            .verdicts
    };
    let idle = |calls: usize| {
        let b = backend.clone();
        async move {
            eventually(std::time::Duration::from_secs(10), || {
                b.calls() == calls && b.active() == 0
            })
            .await
        }
    };
    // Answers cut at two words (the scripted backend's tokens): the check's too.
    let capped = |text: &str| {
        let mut b = chat_body(text);
        b["max_tokens"] = 2.into();
        b
    };
    let r = app.chat(&capped("How do I reset my password?"), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let paraphrase = capped("I forgot my password, how can I change it?");
    assert_eq!(cache_status(&app.chat(&paraphrase, &[]).await), "semantic");
    assert!(idle(2).await, "the check ran");
    // Whole answers: the check gives a verdict (after the first check let go of its permit).
    let r = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let paraphrase = chat_body("I forgot my password, how can I change it?");
    assert_eq!(cache_status(&app.chat(&paraphrase, &[]).await), "semantic");
    assert!(idle(4).await, "the second check ran");
    let app_ref = &app;
    assert!(
        eventually_async(std::time::Duration::from_secs(10), || async {
            app_ref
                .state
                .bounds
                .threshold(
                    "",
                    &reprise_policies::semantic::scope(None),
                    0.02,
                    0.86,
                    0.7,
                )
                .verdicts
                >= 1.0
        })
        .await
    );
    assert_eq!(verdicts(), 1.0, "the cut-off check gave none");
}
