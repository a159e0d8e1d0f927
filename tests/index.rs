//! `[semantic.index]` reaches the index the server runs, over real HTTP with the real ONNX
//! embedder: a partition past its `exact_scan_max` gets an HNSW graph in the background,
//! and paraphrases are then found through the graph; maintenance checks graph searches
//! against exact scans and says so in the metrics.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test]
async fn a_partition_past_the_configured_exact_scan_limit_is_searched_through_its_graph() {
    let mut c = test_config();
    c.semantic.enabled = true;
    c.semantic.index.exact_scan_max = 3;
    c.semantic.index.ef_search = 8;
    c.semantic.index.recall_check_every = 1;
    c.semantic.maintain_interval_secs = 1;
    let (app, _backend) = spawn_fake(c, Default::default()).await;
    let index = app.state.store.index().expect("an index").clone();
    for q in [
        "How do I reset my password?",
        "How do I cancel my subscription?",
        "Where is my parcel now?",
        "Do you ship to Canada?",
        "What payment methods do you accept?",
    ] {
        let r = app.chat(&chat_body(q), &[]).await;
        assert_eq!(cache_status(&r), "miss", "{q}");
    }
    // Past three vectors, maintenance builds the partition's graph at once.
    assert!(
        eventually(Duration::from_secs(30), || index.graphs() == 1).await,
        "no graph built past exact_scan_max = 3"
    );
    let before = index.graph_stats().searches;
    let r = app
        .chat(&chat_body("What are the steps to reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert!(
        index.graph_stats().searches > before,
        "the paraphrase was found through the graph"
    );
    let text = app.metrics_text().await;
    assert_eq!(
        sample(&text, "reprise_semantic_index_graphs", &[]),
        Some(1.0)
    );
    let searches = sample(&text, "reprise_semantic_graph_searches_total", &[]);
    assert!(searches.is_some_and(|n| n >= 1.0), "{searches:?}");
    // Every graph search is checked by the next maintenance pass: five vectors searched
    // eight wide is exhaustive, so the graph found the nearest.
    assert!(
        eventually(Duration::from_secs(30), || index
            .graph_stats()
            .recall_checks
            >= 1)
        .await,
        "the graph search was never checked"
    );
    assert_eq!(index.graph_stats().recall_misses, 0);
    let text = app.metrics_text().await;
    let found = sample(
        &text,
        "reprise_semantic_recall_checks_total",
        &[("result", "found")],
    );
    assert!(found.is_some_and(|n| n >= 1.0), "{found:?}");
    assert_eq!(
        sample(&text, "reprise_semantic_index_search_width", &[]),
        Some(8.0)
    );
}
