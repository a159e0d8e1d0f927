//! Refusals past what one copy of an entry keeps, across replicas through a real Redis: no
//! refusal is ever dropped, the entry goes instead.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise_cache::entry::MAX_KEY_REFUSALS;
use reprise_cache::testing::RedisServer;
use reprise_cache::Entry;

/// `e` refusing the questions `from..from + n` by their keys.
fn refusing(e: &Entry, from: u32, n: usize) -> Entry {
    let mut e = e.clone();
    for i in 0..n as u32 {
        assert!(e.refuse(refusal(from + i)));
    }
    e
}

/// Waits (up to 10 s) for Redis to no longer hold `e`: the delete is queued, not waited for.
async fn gone_from_redis(store: &reprise_cache::Store, e: &Entry) {
    let redis = store.redis().unwrap();
    for _ in 0..200 {
        if redis.get(e.id).await.unwrap().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{} still in Redis", e.id);
}

/// Replica A's copy refuses as many questions as one copy keeps and is in Redis; B, not yet
/// told, refuses one more question on its own copy. Merged with Redis's, that copy would
/// drop a refusal (B's, or one of A's): the entry is deleted everywhere instead, and is not
/// brought back by A's full copy arriving later.
#[tokio::test]
async fn copies_refusing_more_than_one_keeps_delete_the_entry() {
    let server = RedisServer::start();
    let store = |name| replica(&server, name, None, Duration::ZERO);
    let (a, b) = (store("a").await, store("b").await);
    let e = entry("ns", "answer", 60_000);
    a.insert(Arc::new(e.clone()), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();
    assert_eq!(b.fetch(e.id).await.map(|x| x.id), Some(e.id), "B holds it");

    let full = refusing(&e, 1000, MAX_KEY_REFUSALS);
    assert!(full.refusals_full());
    a.update(Arc::new(full.clone())).await;
    let shared = a.redis().unwrap().get(e.id).await.unwrap().expect("held");
    assert!(shared.refusals_full());

    let on_b = refusing(&e, 9000, 1);
    b.update(Arc::new(on_b)).await;
    assert!(b.get(e.id).await.is_none(), "deleted on B");
    gone_from_redis(&b, &e).await;
    // A's full copy reaching B afterwards (a late replication event) stays out.
    b.install(full).await;
    assert!(b.get(e.id).await.is_none(), "not brought back");
}

/// The same on one replica without Redis's copy in the way: a held copy that refuses as many
/// questions as it keeps, and another replica's copy refusing one it does not, arriving by
/// replication (`install`): deleted, where the merge used to keep the first 256 and drop the
/// rest.
#[tokio::test]
async fn an_incoming_copy_past_the_held_ones_room_deletes_the_entry() {
    let server = RedisServer::start();
    let a = replica(&server, "a", None, Duration::ZERO).await;
    let e = entry("ns", "answer", 60_000);
    a.insert(Arc::new(e.clone()), &[digest(1)]).await;
    a.update(Arc::new(refusing(&e, 1000, MAX_KEY_REFUSALS)))
        .await;
    assert!(a.get(e.id).await.expect("held").refusals_full());

    // A copy refusing only questions the held one refuses changes nothing.
    let same = refusing(&e, 1000, 3);
    a.install(same).await;
    assert!(a.get(e.id).await.is_some(), "nothing new: kept");

    let other = refusing(&e, 5000, 1);
    a.install(other).await;
    assert!(a.get(e.id).await.is_none(), "deleted here");
    gone_from_redis(&a, &e).await;
    assert!(matches!(
        a.find(&digest(1), |_| true).await.0,
        reprise_cache::ByKey::Absent
    ));
}

/// A store over `server` whose Redis calls time out after 300 ms and whose breaker tries
/// again after 200 ms (a stopped server fails its calls quickly).
async fn quick_to_give_up(server: &RedisServer) -> reprise_cache::Store {
    let cfg = reprise_cache::redis::RedisConfig {
        timeout_ms: 300,
        breaker_cooldown_ms: 200,
        ..config(server.url())
    };
    reprise_cache::Store::new(
        1 << 20,
        Duration::from_secs(60),
        Duration::ZERO,
        Some(tier(cfg, "a").await),
        None,
        None,
    )
}

/// The Redis delete of an entry refused past its room, failed (Redis down), is tried again:
/// a Redis that comes back holding the entry loses it.
#[tokio::test]
async fn a_delete_redis_could_not_take_is_tried_again() {
    let mut server = RedisServer::start();
    let a = quick_to_give_up(&server).await;
    let e = entry("ns", "answer", 60_000);
    a.insert(Arc::new(e.clone()), &[digest(1)]).await;
    let full = refusing(&e, 1000, MAX_KEY_REFUSALS);
    a.update(Arc::new(full.clone())).await;
    a.redis().unwrap().flush().await.unwrap();

    server.stop();
    a.install(refusing(&e, 5000, 1)).await;
    assert!(a.get(e.id).await.is_none(), "deleted here at once");
    // Redis back, holding the entry (as a persisted or replicated Redis would).
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    let b = tier(config(server.url()), "b").await;
    assert!(b.put(&full, &[digest(1)]));
    b.flush().await.unwrap();
    assert!(b.get(e.id).await.unwrap().is_some(), "held again");
    for _ in 0..300 {
        if b.get(e.id).await.unwrap().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the delete was not tried again");
}

/// A refusal given while Redis was down reaches it once it is back: the update is tried
/// again (merged with the copy Redis holds then).
#[tokio::test]
async fn a_refusal_given_while_redis_was_down_reaches_it_when_back() {
    let mut server = RedisServer::start();
    let a = quick_to_give_up(&server).await;
    let e = entry("ns", "answer", 60_000);
    a.insert(Arc::new(e.clone()), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();

    server.stop();
    a.update(Arc::new(refusing(&e, 7000, 1))).await;
    assert!(
        a.get(e.id).await.unwrap().refuses_key(&digest(7000)),
        "here at once"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    // Redis back, holding the entry without the refusal (and one of another replica's).
    let b = tier(config(server.url()), "b").await;
    assert!(b.put(&refusing(&e, 8000, 1), &[digest(1)]));
    b.flush().await.unwrap();
    for _ in 0..300 {
        let held = b.get(e.id).await.unwrap().expect("held");
        if held.refuses_key(&digest(7000)) {
            assert!(held.refuses_key(&digest(8000)), "merged, not overwritten");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the refusal never reached Redis");
}
