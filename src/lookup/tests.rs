//! The lookup's branches over a deterministic embedder (bag of words: the same words give
//! similarity 1, disjoint words about 0) and a scripted backend; the end-to-end tests
//! run the same paths with the real model.

use std::sync::Arc;

use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::{FinishReason, GenRequest, Usage};
use reprise_embedder::FakeEmbedder;

use super::*;
use crate::config::Config;
use crate::generate::write_back;
use crate::test_support::chat;

fn state_with(embedder: FakeEmbedder, prefetch: bool) -> Arc<AppState> {
    let mut config = Config::default();
    config.semantic.enabled = true;
    config.prefetch.enabled = prefetch;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    AppState::new(config, backend, Some(Arc::new(embedder))).unwrap()
}

fn state() -> Arc<AppState> {
    state_with(FakeEmbedder::new(256), false)
}

async fn find(state: &Arc<AppState>, ns: &str, req: &GenRequest, wants: Wants) -> Lookup {
    let ask = Ask {
        namespace: ns,
        endpoint: Endpoint::Chat,
        req,
        read: true,
        write: true,
        wants,
        counted: false,
    };
    lookup(state, ask).await
}

/// Looks `req` up and stores `answer` for it as a miss would.
async fn store(state: &Arc<AppState>, ns: &str, req: &GenRequest, answer: &str) -> EntryId {
    let found = find(state, ns, req, Wants::default()).await;
    assert!(found.hit.is_none(), "stored only after a miss");
    let usage = Usage::default();
    write_back(
        state,
        found.plan,
        answer.into(),
        FinishReason::Stop,
        usage,
        0,
    )
    .await
}

fn ask(q: &str) -> GenRequest {
    chat(&[("user", q)])
}

/// A state whose embedder reads two wordings of one question as the same vector, with
/// an answer ("E") stored for the first; and the two wordings.
async fn stored_paraphrase() -> (Arc<AppState>, &'static str, &'static str) {
    let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let (y, x) = (
        "How do I reset my password?",
        "How can I reset my password?",
    );
    let s = state_with(FakeEmbedder::new(8).pin(y, &v).pin(x, &v), false);
    store(&s, "ns", &ask(y), "E").await;
    (s, y, x)
}

#[tokio::test]
async fn canonical_context_forms_keep_within_their_byte_budget() {
    let mut config = Config::default();
    config.semantic.enabled = true;
    config.semantic.context_forms_bytes = 64 << 10;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    let s = AppState::new(config, backend, Some(Arc::new(FakeEmbedder::new(64)))).unwrap();
    for i in 0..400 {
        let system = format!(
            "persona{i} speaks with accent{i} about topic{i} {}",
            "x".repeat(200)
        );
        let req = chat(&[
            ("system", &system),
            ("user", "What is the capital of France?"),
        ]);
        find(&s, "ns", &req, Wants::default()).await;
    }
    let held = s.context_forms.weighted_size();
    assert!(held > 0, "forms are kept");
    assert!(
        held <= 64 << 10,
        "{held} bytes held over a budget of 64 KiB"
    );
}

/// The next turn looks up the links of its first `context_turns` exchanges: an answer
/// past them is given no turn link (it would be written and never read).
#[tokio::test]
async fn no_turn_link_past_the_turns_looked_up() {
    let mut config = Config::default();
    config.semantic.enabled = true;
    config.cache.context_turns = 2;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    let s = AppState::new(config, backend, Some(Arc::new(FakeEmbedder::new(64)))).unwrap();
    let mut msgs = Vec::new();
    let mut linked = Vec::new();
    for _ in 0..4 {
        msgs.push(("user", "Why is the sky blue today?"));
        let found = find(&s, "ns", &chat(&msgs), Wants::default()).await;
        linked.push(found.plan.turn.is_some());
        msgs.push(("assistant", "Because of scattering."));
    }
    assert_eq!(linked, [true, true, false, false]);
}

#[tokio::test]
async fn an_exact_repeat_is_an_exact_hit_without_conversation_analysis() {
    let s = state();
    let id = store(&s, "ns", &ask("What is the capital of France?"), "Paris").await;
    let found = find(
        &s,
        "ns",
        &ask("What is the capital of France?"),
        Wants::default(),
    )
    .await;
    let hit = found.hit.expect("a hit");
    assert_eq!((hit.entry.id, hit.outcome), (id, Outcome::Exact));
    // Exact hits skip the conversation (no turn link) unless prefetch wants it.
    assert!(found.plan.turn.is_none());
    assert!(
        found.notes.embed_ms.is_none(),
        "no embedding for an exact hit"
    );
}

#[tokio::test]
async fn with_prefetch_an_exact_hit_still_resolves_its_context() {
    let s = state_with(FakeEmbedder::new(64), true);
    let first = chat(&[("user", "Who wrote Hamlet?")]);
    let prev = store(&s, "ns", &first, "Shakespeare").await;
    let second = chat(&[
        ("user", "Who wrote Hamlet?"),
        ("assistant", "Shakespeare"),
        ("user", "When?"),
    ]);
    store(&s, "ns", &second, "Around 1600").await;
    let found = find(&s, "ns", &second, Wants::default()).await;
    assert_eq!(found.hit.map(|h| h.outcome), Some(Outcome::Exact));
    assert_eq!(found.prev_entry, Some(prev), "the previous turn's entry");
}

/// Context equivalence rewrites an earlier answer to the first answer it paraphrases; the
/// exchange is still known as answered by its own entry (what prefetch learns follow-ups
/// from): its links were made for the question and answer as given.
#[tokio::test]
async fn a_rewritten_exchange_still_names_the_entry_that_answered_it() {
    let (q1, a1) = ("Who wrote Hamlet?", "Shakespeare wrote it, around 1600.");
    let (q2, a2) = (
        "Name the playwright",
        "It was written by Shakespeare around 1600.",
    );
    // The two answers read alike (one vector), the two questions not at all.
    let same: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let (x, y): (Vec<f32>, Vec<f32>) = (
        (0..8).map(|i| f32::from(u8::from(i == 0))).collect(),
        (0..8).map(|i| f32::from(u8::from(i == 1))).collect(),
    );
    let embedder = FakeEmbedder::new(8)
        .pin(a1, &same)
        .pin(a2, &same)
        .pin(q1, &x)
        .pin(q2, &y);
    let s = state_with(embedder, true);
    let first = store(&s, "ns", &ask(q1), a1).await;
    // A conversation shows the first answer: it becomes the form of answers like it.
    let after_first = chat(&[("user", q1), ("assistant", a1), ("user", "When?")]);
    let found = find(&s, "ns", &after_first, Wants::default()).await;
    assert_eq!(found.prev_entry, Some(first));
    // Another question, answered in other words by another entry: its answer is rewritten
    // to the first one's form in the next turn's context.
    let second = store(&s, "ns", &ask(q2), a2).await;
    let after_second = chat(&[("user", q2), ("assistant", a2), ("user", "When?")]);
    let found = find(&s, "ns", &after_second, Wants::default()).await;
    assert_eq!(found.prev_entry, Some(second), "the entry that answered it");
}

#[tokio::test]
async fn a_paraphrase_is_a_semantic_hit_in_its_namespace_only() {
    let s = state();
    let id = store(
        &s,
        "ns",
        &ask("How do I reset my password?"),
        "Click forgot.",
    )
    .await;
    let found = find(
        &s,
        "ns",
        &ask("how do I RESET my password"),
        Wants::default(),
    )
    .await;
    let hit = found.hit.expect("a semantic hit");
    assert_eq!((hit.entry.id, hit.outcome), (id, Outcome::Semantic));
    assert!(hit.similarity.unwrap() > 0.99);
    assert_eq!(found.notes.gate, Some("pass"));
    let other = find(
        &s,
        "other",
        &ask("how do I RESET my password"),
        Wants::default(),
    )
    .await;
    assert!(other.hit.is_none(), "never across namespaces");
}

#[tokio::test]
async fn text_beyond_the_embedders_window_must_match_exactly() {
    // The embedder reads five words: the rest of a question joins the partition.
    let s = state_with(FakeEmbedder::new(256).with_window(5), false);
    let stored = ask("How do I reset my password for the shop?");
    let id = store(&s, "ns", &stored, "Click forgot.").await;
    let entry = s.store.get(id).await.expect("stored");
    // Same five words read, another end: another partition, a miss.
    let found = find(
        &s,
        "ns",
        &ask("How do I reset my email for the shop?"),
        Wants::default(),
    )
    .await;
    assert!(found.hit.is_none(), "the unread end differs");
    assert_eq!(found.plan.read(), "How do I reset my ");
    assert_eq!(found.plan.prompt, "How do I reset my email for the shop?");
    assert_ne!(found.plan.partition, Some(entry.partition));
    // Another wording of what is read, the same end: matched by meaning, and the entry
    // was stored under the partition its plan computed.
    let found = find(
        &s,
        "ns",
        &ask("how do I RESET my password for the shop?"),
        Wants::default(),
    )
    .await;
    assert_eq!(found.plan.partition, Some(entry.partition));
    let hit = found.hit.expect("a semantic hit");
    assert_eq!((hit.entry.id, hit.outcome), (id, Outcome::Semantic));
}

#[tokio::test]
async fn a_candidate_below_the_threshold_is_a_miss_that_notes_its_similarity() {
    let s = state();
    store(
        &s,
        "ns",
        &ask("How do I reset my password?"),
        "Click forgot.",
    )
    .await;
    let q = ask("How do I change my email address?");
    let found = find(&s, "ns", &q, Wants::default()).await;
    assert!(found.hit.is_none());
    let sim = found
        .notes
        .similarity
        .expect("the best candidate's similarity");
    assert!(sim > 0.3 && sim < 0.86, "{sim}");
    // A miss still plans its write-back: partition, prompt and embedding.
    assert!(found.plan.partition.is_some() && found.plan.embedding.is_some());
    assert_eq!(found.plan.prompt, "How do I change my email address?");
}

#[tokio::test]
async fn the_gate_rejects_a_close_candidate_that_says_the_opposite() {
    // Pinned to one vector: only the gate can tell them apart.
    let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let e = FakeEmbedder::new(8)
        .pin("Is the museum open on Monday?", &v)
        .pin("Is the museum not open on Monday?", &v);
    let s = state_with(e, false);
    store(&s, "ns", &ask("Is the museum open on Monday?"), "Yes").await;
    let found = find(
        &s,
        "ns",
        &ask("Is the museum not open on Monday?"),
        Wants::default(),
    )
    .await;
    assert!(found.hit.is_none(), "a negation is not a paraphrase");
    assert!(
        found.notes.gate.is_some_and(|g| g != "pass"),
        "{:?}",
        found.notes.gate
    );
    assert!(found.notes.similarity.unwrap() > 0.99);
}

/// A refusal of a question whose neighbourhood could not be embedded (its key only)
/// still keeps the entry from that very question by meaning.
#[tokio::test]
async fn a_refusal_by_key_alone_keeps_the_question_from_the_entry() {
    let (s, y, x) = stored_paraphrase().await;
    let found = find(&s, "ns", &ask(x), Wants::default()).await;
    let hit = found.hit.expect("a paraphrase hit");
    let mut refusing = (*hit.entry).clone();
    assert!(refusing.refuse(reprise_cache::entry::Refusal {
        key: found.plan.exact,
        around: None,
    }));
    s.store.update(Arc::new(refusing)).await;
    let again = find(&s, "ns", &ask(x), Wants::default()).await;
    assert!(again.hit.is_none(), "refused for this question");
    let own = find(&s, "ns", &ask(y), Wants::default()).await;
    assert_eq!(own.hit.map(|h| h.outcome), Some(Outcome::Exact));
}

/// A hit matched under a canary's candidate policy is served but not linked: the same
/// wording under the running policy is matched by meaning again (where its own rules
/// decide), never served as an exact repeat of the candidate's match.
#[tokio::test]
async fn a_candidate_sides_hit_is_not_linked_to_the_wording() {
    let (s, _, x) = stored_paraphrase().await;
    let candidate = Wants {
        arm: Arm::Candidate,
        ..Wants::default()
    };
    let found = find(&s, "ns", &ask(x), candidate).await;
    let hit = found.hit.as_ref().expect("a paraphrase hit");
    assert_eq!(hit.outcome, Outcome::Semantic);
    crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
    assert!(s.store.get_by_key(&found.plan.exact).await.is_none());
    let again = find(&s, "ns", &ask(x), Wants::default()).await;
    assert_eq!(again.hit.map(|h| h.outcome), Some(Outcome::Semantic));
    // Under the running policy the same hit is linked.
    let found = find(&s, "ns", &ask(x), Wants::default()).await;
    let hit = found.hit.as_ref().unwrap();
    crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
    let again = find(&s, "ns", &ask(x), Wants::default()).await;
    assert_eq!(again.hit.map(|h| h.outcome), Some(Outcome::Exact));
}

#[tokio::test]
async fn a_hit_never_repoints_a_key_that_got_its_own_answer_meanwhile() {
    let (s, _, x) = stored_paraphrase().await;
    let found = find(&s, "ns", &ask(x), Wants::default()).await;
    let hit = found.hit.as_ref().expect("a paraphrase hit");
    assert_eq!(hit.outcome, Outcome::Semantic);
    // Meanwhile a generation for the very question (say, a no-cache request) stores
    // its own answer under its key.
    let fresh = lookup(
        &s,
        Ask {
            namespace: "ns",
            endpoint: Endpoint::Chat,
            req: &ask(x),
            read: false,
            write: true,
            wants: Wants::default(),
            counted: false,
        },
    )
    .await;
    write_back(
        &s,
        fresh.plan,
        "G".into(),
        FinishReason::Stop,
        Usage::default(),
        0,
    )
    .await;
    crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
    let by_key = s.store.get_by_key(&found.plan.exact).await.unwrap();
    assert_eq!(by_key.text, "G", "the paraphrase's answer took the key");
}

#[tokio::test]
async fn a_client_threshold_only_raises_the_bar() {
    let s = state();
    store(
        &s,
        "ns",
        &ask("How do I reset my password today?"),
        "Click forgot.",
    )
    .await;
    let q = ask("How do I reset my password now?");
    let strict = Wants {
        threshold: Some(0.99),
        ..Wants::default()
    };
    assert!(find(&s, "ns", &q, strict).await.hit.is_none());
    let lax = Wants {
        threshold: Some(0.1),
        ..Wants::default()
    };
    // 0.1 does not lower the configured 0.86: the same outcome as asking nothing.
    let default = find(&s, "ns", &q, Wants::default()).await.hit.is_some();
    assert_eq!(find(&s, "ns", &q, lax).await.hit.is_some(), default);
}

/// A wording linked to an entry by a match under the configured threshold is served
/// that entry as an exact repeat, except to a client asking a stricter threshold, which
/// is matched by meaning at its own; the entry's own wording stays an exact hit for it.
#[tokio::test]
async fn a_stricter_client_is_not_served_a_looser_matchs_alias() {
    // Two wordings about 0.95 apart: above the configured 0.86, below a strict 0.97.
    let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let mut w = v.clone();
    w[0] += 4.0;
    w[1] -= 2.0;
    let (y, x) = (
        "How do I reset my password?",
        "How can I reset my password?",
    );
    let s = state_with(FakeEmbedder::new(8).pin(y, &v).pin(x, &w), false);
    store(&s, "ns", &ask(y), "E").await;
    let found = find(&s, "ns", &ask(x), Wants::default()).await;
    let hit = found.hit.as_ref().expect("a paraphrase hit");
    let similarity = hit.similarity.unwrap();
    crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
    let linked = find(&s, "ns", &ask(x), Wants::default()).await;
    assert_eq!(linked.hit.map(|h| h.outcome), Some(Outcome::Exact));
    let strict = Wants {
        threshold: Some((similarity + 1.0) / 2.0),
        ..Wants::default()
    };
    assert!(similarity < 0.999, "a paraphrase, not the same text");
    let found = find(&s, "ns", &ask(x), strict).await;
    assert!(found.hit.is_none(), "below the client's threshold");
    let own = find(&s, "ns", &ask(y), strict).await;
    assert_eq!(own.hit.map(|h| h.outcome), Some(Outcome::Exact));
    // At a threshold the two wordings pass, the entry is found by meaning.
    let passes = Wants {
        threshold: Some(similarity - 0.001),
        ..Wants::default()
    };
    let found = find(&s, "ns", &ask(x), passes).await;
    assert_eq!(found.hit.map(|h| h.outcome), Some(Outcome::Semantic));
    // Without the semantic tier an entry records no wording: its own key stays an exact
    // hit for a client asking a threshold.
    let mut config = Config::default();
    config.semantic.enabled = false;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    let s = AppState::new(config, backend, None).unwrap();
    store(&s, "ns", &ask(y), "E").await;
    let found = find(&s, "ns", &ask(y), strict).await;
    assert_eq!(found.hit.map(|h| h.outcome), Some(Outcome::Exact));
}

#[tokio::test]
async fn an_answer_older_than_max_age_is_not_served_and_keeps_its_key() {
    let s = state();
    let q = ask("What time is it in Tokyo?");
    store(&s, "ns", &q, "Noon").await;
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let fresh_only = Wants {
        freshness: Freshness {
            max_age_secs: Some(0),
        },
        ..Wants::default()
    };
    let found = find(&s, "ns", &q, fresh_only).await;
    assert!(found.hit.is_none(), "too old for max-age=0");
    assert!(found.exact_taken, "the key leads to an older answer");
    let any_age = find(&s, "ns", &q, Wants::default()).await;
    assert_eq!(any_age.hit.map(|h| h.outcome), Some(Outcome::Exact));
}

/// An expired answer kept for the stale windows is found by its exact key only, as
/// stale (never as a hit), when the request takes stale answers and its `max-age`
/// admits it; a paraphrase is not served it by meaning.
#[tokio::test]
async fn an_expired_answer_is_stale_by_its_exact_key_only() {
    let mut config = Config::default();
    config.semantic.enabled = true;
    config.cache.ttl_secs = 1;
    config.cache.stale_while_revalidate_secs = 60;
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    let embedder = Arc::new(FakeEmbedder::new(256));
    let s = AppState::new(config, backend, Some(embedder)).unwrap();
    let q = ask("How do I reset my password?");
    let id = store(&s, "ns", &q, "Click forgot.").await;
    let paraphrase = ask("how do I RESET my password");
    assert!(find(&s, "ns", &paraphrase, Wants::default())
        .await
        .hit
        .is_some());
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let takes_stale = Wants {
        stale: StaleWindows {
            while_revalidate_secs: 60,
            if_error_secs: 0,
        },
        ..Wants::default()
    };
    let found = find(&s, "ns", &q, takes_stale).await;
    assert!(found.hit.is_none(), "never a hit");
    assert_eq!(found.stale.map(|e| e.id), Some(id));
    let found = find(&s, "ns", &q, Wants::default()).await;
    assert!(found.hit.is_none() && found.stale.is_none(), "not taken");
    let found = find(&s, "ns", &paraphrase, takes_stale).await;
    assert!(
        found.hit.is_none() && found.stale.is_none(),
        "not by meaning"
    );
    let too_old = Wants {
        freshness: Freshness {
            max_age_secs: Some(0),
        },
        ..takes_stale
    };
    assert!(find(&s, "ns", &q, too_old).await.stale.is_none(), "max-age");
}

#[tokio::test]
async fn without_read_nothing_is_served_but_the_write_is_planned() {
    let s = state();
    let q = ask("What is the capital of France?");
    store(&s, "ns", &q, "Paris").await;
    let no_read = Ask {
        namespace: "ns",
        endpoint: Endpoint::Chat,
        req: &q,
        read: false,
        write: true,
        wants: Wants::default(),
        counted: false,
    };
    let found = lookup(&s, no_read).await;
    assert!(found.hit.is_none());
    assert!(
        found.plan.embedding.is_some(),
        "a write needs the embedding"
    );
}

#[tokio::test]
async fn a_failing_embedder_degrades_to_exact_only() {
    let s = state_with(FakeEmbedder::new(64).failing(), false);
    let q = ask("What is the capital of France?");
    let found = find(&s, "ns", &q, Wants::default()).await;
    assert!(found.hit.is_none());
    assert!(found.plan.partition.is_some());
    assert!(found.plan.embedding.is_none(), "nothing to index");
    let usage = Usage::default();
    write_back(&s, found.plan, "Paris".into(), FinishReason::Stop, usage, 0).await;
    let again = find(&s, "ns", &q, Wants::default()).await;
    assert_eq!(again.hit.map(|h| h.outcome), Some(Outcome::Exact));
}

#[tokio::test]
async fn the_same_follow_up_after_different_answers_never_matches() {
    let s = state();
    let about = |who: &str, answer: &str| {
        chat(&[
            ("user", &format!("Tell me about {who}")),
            ("assistant", answer),
            ("user", "How old is he?"),
        ])
    };
    store(&s, "ns", &about("Alan Turing", "A mathematician."), "41").await;
    let found = find(
        &s,
        "ns",
        &about("Isaac Newton", "A physicist."),
        Wants::default(),
    )
    .await;
    assert!(found.hit.is_none(), "another conversation context");
    let same = find(
        &s,
        "ns",
        &about("Alan Turing", "A mathematician."),
        Wants::default(),
    )
    .await;
    assert_eq!(same.hit.map(|h| h.outcome), Some(Outcome::Exact));
}
