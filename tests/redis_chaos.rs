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

/// The id of the entry `app` holds for `question` (the scripted backend's answer names it).
fn held(app: &TestApp, question: &str) -> Option<reprise_cache::EntryId> {
    app.state
        .store
        .entries()
        .iter()
        .find(|e| e.text == format!("You asked: {question}"))
        .map(|e| e.id)
}

/// A connection of the test's own to `redis`.
async fn connect(redis: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A policy event (which stalls a consumer holding the policy lock), then 1,400 other
/// events: more than a reader buffers, so a stalled replica's reader stops reading too.
async fn flood_events(c: &mut redis::aio::MultiplexedConnection) {
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
    let mut pipe = redis::pipe();
    pipe.add_command(xadd("policies", "version", "1000000".into()));
    for _ in 0..1_400 {
        pipe.add_command(xadd(
            "put",
            "id",
            reprise_cache::EntryId::random().to_string(),
        ));
    }
    let _: Vec<String> = pipe.query_async(c).await.unwrap();
}

/// Trims the event stream to nothing (as the writers' `MAXLEN` does once enough events
/// follow); how many events went.
async fn trim_events(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis::cmd("XTRIM")
        .arg("reprise:events")
        .arg("MAXLEN")
        .arg(0)
        .query_async(c)
        .await
        .unwrap()
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
    let mut c = connect(&redis).await;
    flood_events(&mut c).await;

    // A deletes one entry and a tag; then the stream is trimmed past both events (as the
    // writers' `MAXLEN` does once enough events follow).
    assert!(a.state.store.delete(deleted_id).await.unwrap());
    assert_eq!(a.state.store.delete_tag("doc-1").await.unwrap(), 1);
    let trimmed = trim_events(&mut c).await;
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

/// A replica whose catch-up fails (its circuit breaker still open when it learns it missed
/// events) tries again until it goes through: the deletes it missed are honoured.
#[tokio::test]
async fn a_catch_up_that_fails_is_tried_again() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let mut slow = redis_config(redis.url());
    slow.redis.breaker_cooldown_ms = 15_000;
    let b = spawn_replica(slow, Arc::new(backend.clone())).await;
    let (deleted, kept) = (
        "How do I reset my password?",
        "What is the capital of France?",
    );
    for q in [deleted, kept] {
        assert_eq!(cache_status(&a.chat(&chat_body(q), &[]).await), "miss");
    }
    assert!(
        eventually(Duration::from_secs(20), || held(&b, deleted).is_some()
            && held(&b, kept).is_some())
        .await
    );
    // B's consumer stalls while its events are trimmed away behind a delete (as above).
    let guard = b.state.policy_change.lock().await;
    let mut c = connect(&redis).await;
    flood_events(&mut c).await;
    assert!(a
        .state
        .store
        .delete(held(&a, deleted).unwrap())
        .await
        .unwrap());
    trim_events(&mut c).await;
    // Redis stops answering for a moment: B's reads time out and its breaker opens, for
    // longer than a few quick tries would wait.
    open_breaker(&redis.url(), b.state.store.redis().unwrap(), 1_500).await;
    drop(guard);
    assert!(
        eventually(Duration::from_secs(40), || held(&b, deleted).is_none()).await,
        "B still serves the deleted entry (rebuilds {})",
        b.state.rebuilds.load(std::sync::atomic::Ordering::SeqCst)
    );
    assert!(held(&b, kept).is_some());
}

/// Redis killed and restarted while clients send requests concurrently: every request is
/// answered (200, a complete body), and writes reach Redis again once it is back.
#[tokio::test]
async fn redis_killed_and_restarted_under_load_fails_no_request() {
    let mut redis = RedisServer::start();
    let backend = scripted();
    // Exact matching only: the questions differ in numbers alone, which meaning may not.
    let mut config = redis_config(redis.url());
    config.semantic.enabled = false;
    let app = Arc::new(spawn_replica(config, Arc::new(backend.clone())).await);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let app = app.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut sent = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || sent < 10 {
                    // Repeats (hits) and new questions (misses, written to Redis) mixed.
                    let q = format!("client {c} question {}", sent % 13 + (sent / 40) * 13);
                    let r = app.chat(&chat_body(&q), &[]).await;
                    assert_eq!(r.status(), 200, "request {sent} of client {c}");
                    let text = content(r).await;
                    assert_eq!(text, format!("You asked: {q}"));
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    // Kill and restart Redis twice while they run.
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        redis.stop();
        tokio::time::sleep(Duration::from_millis(500)).await;
        redis.restart();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for c in clients {
        total += c.await.expect("no client saw a failed request");
    }
    assert!(total >= 80);

    // Writes resume: a new answer reaches Redis.
    let tier = app.state.store.redis().unwrap();
    let mut resumed = false;
    for i in 0..50 {
        let q = format!("after the restarts {i}");
        assert_eq!(app.chat(&chat_body(&q), &[]).await.status(), 200);
        let _ = tier.flush().await;
        let id = held(&app, &q).unwrap();
        if tier.get(id).await.is_ok_and(|e| e.is_some()) {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(resumed, "writes to Redis resumed");
}

/// Redis restarted without persistence comes back empty. Nothing was deleted, so the replica
/// writes what it holds back (Redis's epoch changed) instead of dropping it as if deleted:
/// its answers stay hits and reach Redis again.
#[tokio::test]
async fn a_replica_writes_back_what_a_wiped_redis_lost() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut redis = RedisServer::start();
    let backend = scripted();
    let mut config = redis_config(redis.url());
    config.semantic.enabled = false;
    let app = spawn_replica(config, Arc::new(backend.clone())).await;
    let rebuilt = |n: u64| {
        let app = &app;
        async move {
            eventually(Duration::from_secs(60), || {
                app.state.rebuilds.load(SeqCst) > n
            })
            .await
        }
    };
    assert!(rebuilt(0).await, "the start's rebuild");
    let q = "What survives a restart?";
    assert_eq!(cache_status(&app.chat(&chat_body(q), &[]).await), "miss");
    let tier = app.state.store.redis().unwrap();
    tier.flush().await.unwrap();
    let id = held(&app, q).unwrap();
    assert!(tier.get(id).await.unwrap().is_some());

    let before = app.state.rebuilds.load(SeqCst);
    redis.restart();
    assert!(rebuilt(before).await, "a resync after the restart");
    assert_eq!(cache_status(&app.chat(&chat_body(q), &[]).await), "exact");
    assert!(
        tier.get(id).await.unwrap().is_some(),
        "written back to redis"
    );
    assert_eq!(backend.calls(), 1);
}

/// While Redis cannot be reached, an admin change that needs it is a 503 with `Retry-After`
/// (it may be sent again as it was), not a server error; once Redis is back it goes through.
#[tokio::test]
async fn admin_changes_while_redis_is_down_are_told_to_retry() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_DOWN_ADMIN_TOKEN", "d0wn");
    let mut redis = RedisServer::start();
    let mut config = redis_config(redis.url());
    config.semantic.enabled = false;
    config.server.admin_token_env = Some("REPRISE_TEST_DOWN_ADMIN_TOKEN".into());
    let app = spawn_replica(config, Arc::new(scripted())).await;
    redis.stop();
    let delete = || {
        app.client
            .delete(app.url("/admin/namespaces/default"))
            .bearer_auth("d0wn")
            .send()
    };
    let r = delete().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let j = assert_openai_error(r, 503, None).await;
    assert_eq!(j["error"]["code"], "unavailable", "{j}");
    redis.restart();
    let mut done = false;
    for _ in 0..100 {
        if delete().await.unwrap().status() == 200 {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(done, "the delete went through once Redis was back");
}
