//! The real ONNX embedder: similarity sanity, normalisation, micro-batching, the LRU and
//! load errors.

mod common;

use std::sync::Arc;

use reprise_embedder::{cosine, EmbedError, Embedder, EmbedderConfig, FastEmbedder};

fn load(cfg: EmbedderConfig) -> FastEmbedder {
    FastEmbedder::load(cfg).expect("the model files are in models/ (see scripts/)")
}

#[tokio::test]
async fn paraphrases_are_close_and_unrelated_questions_are_not() {
    let e = load(common::config());
    let reset = e.embed("How do I reset my password?").await.unwrap();
    let forgot = e
        .embed("I forgot my password, how can I change it?")
        .await
        .unwrap();
    let capital = e.embed("What is the capital of France?").await.unwrap();

    let close = cosine(&reset, &forgot);
    assert!(close > 0.8, "paraphrase cosine {close}");
    assert!((close - 0.894).abs() < 0.02, "paraphrase cosine {close}");
    assert!(cosine(&reset, &capital) < 0.3);
    assert!(cosine(&forgot, &capital) < 0.3);
}

#[tokio::test]
async fn vectors_are_normalised_with_384_components() {
    let e = load(common::config());
    assert_eq!(e.dim(), 384);
    let texts: Vec<String> = [
        "short",
        "a somewhat longer sentence about caching answers",
        "",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let vectors = e.embed_many(&texts).await.unwrap();
    assert_eq!(vectors.len(), 3);
    for v in &vectors {
        assert_eq!(v.len(), 384);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "norm {norm}");
    }
}

#[tokio::test]
async fn batched_and_single_embeddings_agree() {
    // Padding to the longest in a batch must not change a short text's vector.
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        ..common::config()
    });
    let alone = e.embed("hi").await.unwrap();
    let texts = vec![
        "hi".to_string(),
        "a much longer sentence that forces padding of the short one in the same batch".to_string(),
    ];
    let batched = e.embed_many(&texts).await.unwrap();
    assert!(cosine(&alone, &batched[0]) > 0.999);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_share_model_batches() {
    let e = Arc::new(load(EmbedderConfig {
        // A wide window so the test does not depend on scheduling luck.
        batch_wait_us: 20_000,
        ..common::config()
    }));
    let before = e.stats();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let e = Arc::clone(&e);
            tokio::spawn(async move { e.embed(&format!("question number {i}")).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().len(), 384);
    }
    let after = e.stats();
    let batches = after.batches - before.batches;
    assert_eq!(after.texts_embedded - before.texts_embedded, 16);
    assert!(batches < 16, "16 concurrent texts took {batches} batches");
    assert!(batches <= 4, "16 concurrent texts took {batches} batches");
}

#[tokio::test]
async fn a_repeat_is_answered_by_the_cache() {
    let e = load(common::config());
    let first = e.embed("Where is my order?").await.unwrap();
    let before = e.stats();
    let again = e.embed("Where is my order?").await.unwrap();
    let after = e.stats();
    assert_eq!(after.batches, before.batches);
    assert_eq!(after.cache_hits, before.cache_hits + 1);
    assert!(Arc::ptr_eq(&first, &again));
}

#[tokio::test]
async fn a_scope_never_reuses_another_scopes_cached_text() {
    let e = load(common::config());
    let a = e.embed_in("tenant-a", "Where is my parcel?").await.unwrap();
    let before = e.stats();
    // Another tenant asks the same text: computed again (a cache hit would answer faster and
    // tell it what tenant-a asked).
    let b = e.embed_in("tenant-b", "Where is my parcel?").await.unwrap();
    let after = e.stats();
    assert_eq!(after.cache_hits, before.cache_hits);
    assert_eq!(after.texts_embedded, before.texts_embedded + 1);
    assert!(!Arc::ptr_eq(&a, &b));
    assert!(reprise_embedder::cosine(&a, &b) > 0.999, "the same vector");
    // The same scope again is a cache hit.
    let again = e.embed_in("tenant-b", "Where is my parcel?").await.unwrap();
    assert!(Arc::ptr_eq(&b, &again));
    let many = e
        .embed_many_in("tenant-c", &["Where is my parcel?".to_string()])
        .await
        .unwrap();
    assert!(!Arc::ptr_eq(&many[0], &a) && !Arc::ptr_eq(&many[0], &b));
}

#[tokio::test]
async fn a_missing_model_dir_is_an_error_naming_it() {
    let cfg = EmbedderConfig {
        model_dir: "/nonexistent/reprise-model".into(),
        ..common::config()
    };
    let err = FastEmbedder::load(cfg).unwrap_err();
    assert!(matches!(err, EmbedError::ModelFile { .. }), "{err:?}");
    assert_eq!(err.kind(), "model_file");
    assert!(
        err.to_string().contains("/nonexistent/reprise-model"),
        "{err}"
    );
}

#[tokio::test]
async fn a_missing_model_file_is_an_error_naming_it() {
    let dir = std::env::temp_dir().join(format!("reprise-embedder-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = EmbedderConfig {
        model_dir: dir.clone(),
        ..common::config()
    };
    let err = FastEmbedder::load(cfg).unwrap_err();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(err.kind(), "model_file");
    assert!(
        err.to_string()
            .contains(&dir.join("config.json").display().to_string()),
        "{err}"
    );
}

#[test]
fn zero_max_batch_is_refused() {
    let err = FastEmbedder::load(EmbedderConfig {
        max_batch: 0,
        ..common::config()
    })
    .unwrap_err();
    assert_eq!(err.kind(), "config");
}

#[test]
fn config_rejects_unknown_fields_and_fills_defaults() {
    // serde_json is not a dependency here; the `IntoDeserializer` route keeps it that way.
    use serde::de::value::{Error, MapDeserializer};
    use serde::Deserialize;
    let fields = [("max_batch", 8u64)];
    let cfg =
        EmbedderConfig::deserialize(MapDeserializer::<_, Error>::new(fields.into_iter())).unwrap();
    assert_eq!(cfg.max_batch, 8);
    assert_eq!(cfg.max_tokens, 256);
    let bad = [("max_batchez", 8u64)];
    assert!(
        EmbedderConfig::deserialize(MapDeserializer::<_, Error>::new(bad.into_iter())).is_err()
    );
}

/// Distinct English-like words, `n` of them, for texts longer than the model reads.
fn words(n: usize, salt: &str) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{salt}{} item{i}",
                ["alpha", "beta", "gamma", "delta"][i % 4]
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn the_window_ends_where_the_model_stops_reading() {
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        ..common::config()
    });
    // 256 tokens less [CLS] and [SEP].
    assert_eq!(e.max_tokens(), 254);
    let short = "How do I reset my password?";
    assert_eq!(e.window(short), short.len());
    assert_eq!(e.split(short), (short, ""));

    for text in [
        words(300, ""),
        format!(
            "Ünïcödé façade {} 東京の天気は {}",
            words(150, "ça"),
            words(150, "x")
        ),
    ] {
        let (read, rest) = e.split(&text);
        assert!(!read.is_empty() && !rest.is_empty(), "{text}");
        let whole = e.embed(&text).await.unwrap();
        // Nothing after the window changes the vector...
        assert_eq!(e.embed(read).await.unwrap(), whole);
        let other_end = format!("{read} and then something else entirely");
        assert_eq!(e.embed(&other_end).await.unwrap(), whole);
        // ...and the window holds no less than the model reads: its last word counts.
        let shorter = &read[..read.trim_end().rfind(' ').unwrap()];
        assert_ne!(e.embed(shorter).await.unwrap(), whole);
    }

    // Too few tokens in the scanned start (a long run of spaces): read up to where the scan
    // ended, which the model reads whole.
    let spaced = format!("a few words{}and more after them", " ".repeat(40 * 1024));
    let n = e.window(&spaced);
    assert!(n >= "a few words".len() && n <= reprise_embedder::SCAN_BYTES[1]);
    // No whitespace to cut at in the scan: nothing counts as read for sure.
    let unbroken = "x".repeat(40 * 1024);
    assert_eq!(e.window(&unbroken), 0);
    // A megabyte costs what its scanned start costs.
    let long = words(200_000, "");
    assert!(long.len() > 1_000_000);
    assert_eq!(e.window(&long), e.window(&long[..20 * 1024]));
}

/// Words outside the vocabulary (most emoji, an overlong word) read as one unknown token,
/// so texts differing only there embed alike: the reading names them, in order.
#[tokio::test]
async fn the_reading_names_the_words_the_model_cannot_spell() {
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        ..common::config()
    });
    let (a, b) = ("What does 🦄 mean?", "What does 🐉 mean?");
    assert_eq!(e.embed(a).await.unwrap(), e.embed(b).await.unwrap());
    let r = e.reading(a);
    assert_eq!(r.end, a.len());
    assert_eq!(r.unknown_words(a), ["🦄"]);
    assert!(!r.is_whole(a.len()));
    let long = "y".repeat(150);
    let text = format!("explain photosynthesis🌱 and {long} today");
    assert_eq!(
        e.reading(&text).unknown_words(&text),
        ["photosynthesis🌱", long.as_str()]
    );
    // Known words only: nothing named, read whole.
    let plain = "How do I reset my password?";
    assert!(e.reading(plain).is_whole(plain.len()));
}

#[tokio::test]
async fn a_character_the_model_reads_only_in_part_is_left_out_of_the_window() {
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        ..common::config()
    });
    // The normaliser splits a Hangul syllable into its jamo, a token each, three here: 84
    // syllables are 252 tokens, so the model reads two jamo of the 85th and stops. "한" and
    // "할" differ only in the third.
    let a = format!("{}한 tail words", "한 ".repeat(84));
    let b = format!("{}할 tail words", "한 ".repeat(84));
    assert_eq!(e.embed(&a).await.unwrap(), e.embed(&b).await.unwrap());
    // What tells them apart is not in the window, so the rest (matched exactly) differs.
    let ((read_a, rest_a), (read_b, rest_b)) = (e.split(&a), e.split(&b));
    assert_eq!(read_a, read_b);
    assert_ne!(rest_a, rest_b);
    assert!(
        rest_a.starts_with('한') && rest_b.starts_with('할'),
        "{rest_a}"
    );
}

#[test]
fn max_tokens_must_leave_a_token_of_the_text_to_read() {
    // [CLS] and [SEP] take two: at two the model reads nothing of a text.
    for n in [0, 1, 2] {
        let err = FastEmbedder::load(EmbedderConfig {
            max_tokens: n,
            ..common::config()
        })
        .unwrap_err();
        assert_eq!(err.kind(), "config", "{n}");
    }
    assert!(FastEmbedder::load(EmbedderConfig {
        max_tokens: 3,
        ..common::config()
    })
    .is_ok());
}

#[tokio::test]
async fn the_text_cache_is_bounded_by_bytes() {
    let cap = 64 * 1024;
    let e = load(EmbedderConfig {
        cache_bytes: cap,
        ..common::config()
    });
    // 120 texts of ~450 bytes: each entry weighs its text, a 1,536-byte vector and an
    // overhead, so about 30 fit, far fewer than a count of entries would allow.
    let texts: Vec<String> = (0..120).map(|i| words(40, &format!("t{i}x"))).collect();
    assert!(texts.iter().all(|t| t.len() > 400));
    e.embed_many(&texts).await.unwrap();
    let (entries, bytes) = e.cache_usage();
    assert!(bytes <= cap, "{bytes} bytes held, cap {cap}");
    assert!(entries > 0 && entries < 60, "{entries} entries held");
    // Weighed by bytes: each entry counts at least its text and its vector.
    assert!(
        bytes >= entries * (400 + 384 * 4),
        "{bytes} bytes for {entries} entries"
    );
    // Least recently used first: the texts embedded last are the ones held.
    let hits = e.stats().cache_hits;
    for t in &texts[texts.len() - 5..] {
        e.embed(t).await.unwrap();
    }
    assert_eq!(e.stats().cache_hits, hits + 5);
}

/// A text of about `tokens` tokens (ordinary words: one token each).
fn sentence(tokens: usize, salt: usize) -> String {
    let words = [
        "cache", "answer", "question", "model", "server", "tenant", "prompt",
    ];
    (0..tokens)
        .map(|i| words[(i + salt) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Background embedding never takes the room clients need: refused while less than half of
/// the queue is free, served once it is.
#[tokio::test]
async fn spare_embedding_leaves_the_queue_to_clients() {
    let e = std::sync::Arc::new(load(EmbedderConfig {
        cache_bytes: 0,
        queue_texts: 4,
        // The round stays open while the clients' texts hold the queue (long enough for a
        // busy machine to reach the refused call first).
        batch_wait_us: 2_000_000,
        ..common::config()
    }));
    let clients: Vec<_> = (0..3)
        .map(|i| {
            let e = e.clone();
            tokio::spawn(async move { e.embed(&format!("client question {i}")).await })
        })
        .collect();
    let queued = async {
        while e.queued() < 3 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), queued)
        .await
        .expect("the clients' texts are queued");
    let texts = ["an answer".to_string(), "another answer".to_string()];
    let refused = e.embed_many_spare("", &texts).await;
    assert!(
        matches!(refused, Err(EmbedError::Overloaded { .. })),
        "{refused:?}"
    );
    for c in clients {
        c.await.unwrap().unwrap();
    }
    assert_eq!(e.embed_many_spare("", &texts).await.unwrap().len(), 2);
}

/// Background callers asking at once hold at most half of the queue together (each alone
/// would find half of it free), so a client always finds room.
#[tokio::test]
async fn spare_embedding_holds_at_most_half_the_queue_together() {
    let e = std::sync::Arc::new(load(EmbedderConfig {
        cache_bytes: 0,
        queue_texts: 8,
        // The round stays open while the background texts hold the queue.
        batch_wait_us: 1_500_000,
        ..common::config()
    }));
    let spare: Vec<_> = (0..4)
        .map(|i| {
            let e = e.clone();
            let texts = vec![format!("answer {i} a"), format!("answer {i} b")];
            tokio::spawn(async move { e.embed_many_spare("", &texts).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let held = e.queued();
    assert!(held <= 4, "background work holds {held} of 8");
    // A client finds room at once beside them.
    e.embed("a client question").await.unwrap();
    let mut refused = 0;
    for s in spare {
        match s.await.unwrap() {
            Ok(v) => assert_eq!(v.len(), 2),
            Err(EmbedError::Overloaded { .. }) => refused += 1,
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(refused, 2, "two calls of two texts fill the spare half");
}

/// A text whose caller gave up before its round ran is not embedded (its room is freed);
/// a text asked meanwhile is.
#[tokio::test]
async fn a_text_nobody_waits_for_is_not_embedded() {
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        // The round stays open long enough for the caller below to give up first, even on
        // a busy machine.
        batch_wait_us: 2_000_000,
        ..common::config()
    });
    let gave_up = tokio::time::timeout(
        std::time::Duration::from_millis(20),
        e.embed("a question nobody waits for"),
    )
    .await;
    assert!(gave_up.is_err(), "the round was still open");
    e.embed("a question someone waits for").await.unwrap();
    assert_eq!(e.stats().texts_embedded, 1);
}

#[tokio::test]
async fn a_mixed_round_is_split_by_length_and_every_vector_is_its_own() {
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        // The round stays open long enough for every text below to join it.
        batch_wait_us: 200_000,
        // Six long texts in one call: the working-memory budget does not cut them here.
        memory_bytes: 1 << 30,
        ..common::config()
    });
    // Short and long texts, interleaved.
    let texts: Vec<String> = (0..12)
        .map(|i| match i % 2 {
            0 => format!("short question {i}"),
            _ => sentence(200, i),
        })
        .collect();
    let mut alone = Vec::new();
    for t in &texts {
        alone.push(e.embed(t).await.unwrap());
    }
    let before = e.stats();
    let together = e.embed_many(&texts).await.unwrap();
    let after = e.stats();
    // One round, run as two model calls: the short texts, then the long ones.
    assert_eq!(after.rounds - before.rounds, 1);
    assert_eq!(after.batches - before.batches, 2);
    assert_eq!(after.texts_embedded - before.texts_embedded, 12);
    // Padding: the short texts were not padded to the long ones (one call would have padded
    // all 12 to about 200 tokens).
    let padded = after.padded_tokens - before.padded_tokens;
    let real = after.tokens - before.tokens;
    assert!(padded < 12 * 200, "{padded} padded tokens");
    assert!(padded <= real + 12, "{padded} padded for {real} tokens");
    // Every caller got the vector of its own text, as embedded alone.
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        let diff = a
            .iter()
            .zip(b.iter())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-4, "text {i}: max difference {diff}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_refuses_at_once_and_never_grows() {
    let e = Arc::new(load(EmbedderConfig {
        cache_bytes: 0,
        queue_texts: 2,
        queue_wait_ms: 0,
        // The first round stays open while the other callers arrive.
        batch_wait_us: 300_000,
        ..common::config()
    }));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let e = Arc::clone(&e);
            tokio::spawn(async move { e.embed(&format!("question number {i}")).await })
        })
        .collect();
    let (mut ok, mut refused) = (0u64, 0u64);
    for t in tasks {
        match t.await.unwrap() {
            Ok(v) => {
                assert_eq!(v.len(), 384);
                ok += 1;
            }
            Err(err) => {
                assert!(
                    matches!(
                        err,
                        EmbedError::Overloaded {
                            retry_after_secs: 1
                        }
                    ),
                    "{err:?}"
                );
                assert_eq!(err.kind(), "overloaded");
                refused += 1;
            }
        }
    }
    let s = e.stats();
    assert_eq!(ok + refused, 32);
    assert!(ok >= 2, "{ok} answered");
    assert!(refused > 0, "nothing refused");
    assert_eq!(s.refused, refused);
    assert_eq!(s.texts_embedded, ok);
    // Never more than the queue's two texts in one round.
    assert!(s.texts_embedded <= 2 * s.rounds, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_makes_callers_wait_for_room() {
    let e = Arc::new(load(EmbedderConfig {
        cache_bytes: 0,
        queue_texts: 2,
        queue_wait_ms: 600_000,
        ..common::config()
    }));
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let e = Arc::clone(&e);
            tokio::spawn(async move { e.embed(&format!("question number {i}")).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().len(), 384);
    }
    let s = e.stats();
    assert_eq!((s.texts_embedded, s.refused), (16, 0));
    // Everyone waited for room: no round held more than the queue's two texts.
    assert!(s.rounds >= 8, "{s:?}");
}

#[test]
fn zero_batch_tokens_or_queue_is_refused() {
    for cfg in [
        EmbedderConfig {
            batch_tokens: 0,
            ..common::config()
        },
        EmbedderConfig {
            queue_texts: 0,
            ..common::config()
        },
    ] {
        assert_eq!(FastEmbedder::load(cfg).unwrap_err().kind(), "config");
    }
}

#[test]
fn a_memory_budget_that_cannot_hold_one_long_text_is_refused() {
    let err = FastEmbedder::load(EmbedderConfig {
        memory_bytes: 1 << 20,
        ..common::config()
    })
    .unwrap_err();
    assert_eq!(err.kind(), "config");
    assert!(err.to_string().contains("memory_bytes"), "{err}");
}

#[tokio::test]
async fn long_texts_are_embedded_a_few_at_a_time_within_the_memory_budget() {
    // Eight texts of 256 tokens are 2048 padded tokens, within the token budget for one
    // call; their working memory (about 40 MB each) is not within 128 MiB.
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        memory_bytes: 128 << 20,
        ..common::config()
    });
    let texts: Vec<String> = (0..8)
        .map(|i| format!("{i} {}", "time ".repeat(300)))
        .collect();
    let alone = e.embed(&texts[0]).await.unwrap();
    let before = e.stats();
    let vectors = e.embed_many(&texts).await.unwrap();
    let s = e.stats();
    let (calls, texts_run) = (
        s.batches - before.batches,
        s.texts_embedded - before.texts_embedded,
    );
    assert_eq!(texts_run, 8);
    assert!(calls >= 3, "{calls} calls for 8 long texts: {s:?}");
    // The cut changes no vector.
    assert!(cosine(&alone, &vectors[0]) > 0.9999);
}

/// A text of megabytes (an answer judged in the background) is read as far as the model
/// reads (`model_start`): its vector is its start's.
#[tokio::test]
async fn a_megabyte_text_is_embedded_as_its_start() {
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        ..common::config()
    });
    let long = "The answer explains the refund policy in detail. ".repeat(80_000);
    let start = reprise_embedder::model_start(&long);
    assert!(start.len() < long.len() / 50);
    let (whole, cut) = (e.embed(&long).await.unwrap(), e.embed(start).await.unwrap());
    assert!(cosine(&whole, &cut) > 0.9999);
}

#[tokio::test]
async fn a_long_text_counts_as_the_model_reads_it_not_as_its_scanned_start() {
    // The model reads 256 tokens of each text; the first 16 KiB (what is counted) hold two
    // of them. Counted as 2, all eight would go in one call past the memory budget.
    let e = load(EmbedderConfig {
        cache_bytes: 0,
        memory_bytes: 128 << 20,
        ..common::config()
    });
    let texts: Vec<String> = (0..8)
        .map(|i| format!("{i}{}{}", " ".repeat(17 * 1024), "time ".repeat(300)))
        .collect();
    let before = e.stats();
    e.embed_many(&texts).await.unwrap();
    let s = e.stats();
    let calls = s.batches - before.batches;
    assert!(calls >= 3, "{calls} calls for 8 long texts: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_text_is_answered_before_the_long_calls_of_its_round() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // One round (the batcher waits for more texts): eight long texts need several model
    // calls within the memory budget, the short one goes first and is answered at once.
    let e = Arc::new(load(EmbedderConfig {
        cache_bytes: 0,
        memory_bytes: 128 << 20,
        batch_wait_us: 300_000,
        ..common::config()
    }));
    let texts: Vec<String> = (0..8)
        .map(|i| format!("{i} {}", "time ".repeat(300)))
        .collect();
    let answered = Arc::new(AtomicUsize::new(0));
    let long = {
        let (e, answered) = (e.clone(), answered.clone());
        tokio::spawn(async move {
            e.embed_many(&texts).await.unwrap();
            answered.fetch_add(1, Ordering::SeqCst)
        })
    };
    let short = {
        let (e, answered) = (e.clone(), answered.clone());
        tokio::spawn(async move {
            e.embed("How do I reset my password?").await.unwrap();
            answered.fetch_add(1, Ordering::SeqCst)
        })
    };
    let (long, short) = (long.await.unwrap(), short.await.unwrap());
    assert_eq!((short, long), (0, 1));
    assert_eq!(e.stats().rounds, 1, "{:?}", e.stats());
}
