//! The shared Redis tier under faults, through the server: Redis killed and restarted under
//! concurrent load fails no client request, and a replica that fell behind the trimmed event
//! stream honours every delete once it catches up. Real redis-server processes, the real
//! embedder; a scripted backend (counting only).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise::Config;
use reprise_cache::testing::RedisServer;

fn redis_config(url: String) -> Config {
    let mut c = test_config();
    c.semantic.enabled = true;
    c.redis.url = Some(url);
    c.redis.breaker_cooldown_ms = 300;
    c
}

/// The id of the entry `app` holds for `question`.
fn held(app: &TestApp, question: &str) -> Option<reprise_cache::EntryId> {
    app.state
        .store
        .entries()
        .iter()
        .find(|e| e.prompt == question)
        .map(|e| e.id)
}

#[tokio::test]
async fn a_replica_lagging_past_the_trimmed_stream_honours_every_delete() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let b = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let deleted = "How do I reset my password?";
    let tagged = "How do I export a PNG?";
    let kept = "What is the capital of France?";
    for (q, tags) in [(deleted, ""), (tagged, "doc-1"), (kept, "")] {
        let headers: Vec<(&str, &str)> = if tags.is_empty() {
            vec![]
        } else {
            vec![("x-reprise-tags", tags)]
        };
        assert_eq!(cache_status(&a.chat(&chat_body(q), &headers).await), "miss");
    }
    // B has all three from the event stream.
    assert!(
        eventually(Duration::from_secs(20), || [deleted, tagged, kept]
            .iter()
            .all(|q| held(&b, q).is_some()))
        .await
    );
    let deleted_id = held(&a, deleted).unwrap();

    // B's consumer stalls (on the policy lock, behind a policy event) while 1,400 other events
    // arrive: more than its reader buffers, so the reader stops reading too.
    let guard = b.state.policy_change.lock().await;
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let xadd = |op: &str, field: &str, value: String| {
        redis::cmd("XADD")
            .arg("reprise:events")
            .arg("*")
            .arg("op")
            .arg(op)
            .arg(field)
            .arg(value)
            .arg("ns")
            .arg("elsewhere")
            .arg("origin")
            .arg("another-replica")
            .clone()
    };
    let _: String = xadd("policies", "version", "1000000".into())
        .query_async(&mut c)
        .await
        .unwrap();
    let mut pipe = redis::pipe();
    for _ in 0..1_400 {
        pipe.add_command(xadd(
            "put",
            "id",
            reprise_cache::EntryId::random().to_string(),
        ));
    }
    let _: Vec<String> = pipe.query_async(&mut c).await.unwrap();

    // A deletes one entry and a tag; then the stream is trimmed past both events (as the
    // writers' `MAXLEN` does once enough events follow).
    assert!(a.state.store.delete(deleted_id).await.unwrap());
    assert_eq!(a.state.store.delete_tag("doc-1").await.unwrap(), 1);
    let trimmed: u64 = redis::cmd("XTRIM")
        .arg("reprise:events")
        .arg("MAXLEN")
        .arg(0)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(trimmed > 1_400, "{trimmed}");
    assert!(held(&b, deleted).is_some() && held(&b, tagged).is_some());

    // B catches up: both deletes are honoured, the rest stays.
    drop(guard);
    assert!(
        eventually(Duration::from_secs(30), || held(&b, deleted).is_none()
            && held(&b, tagged).is_none())
        .await,
        "B still serves deleted entries (rebuilds {})",
        b.state.rebuilds.load(std::sync::atomic::Ordering::SeqCst)
    );
    assert!(held(&b, kept).is_some());
    let only = [("cache-control", "only-if-cached")];
    assert_eq!(b.chat(&chat_body(deleted), &only).await.status(), 504);
    assert_eq!(b.chat(&chat_body(tagged), &only).await.status(), 504);
    assert_eq!(
        cache_status(&b.chat(&chat_body(kept), &only).await),
        "exact"
    );
    assert_eq!(backend.calls(), 3);
}
