//! The store and the Redis tier under faults and races, against real `redis-server`
//! processes: a Redis that cannot answer never tombstones a semantic candidate, a deletion
//! wins over a promotion that read the entry before it, index sets outlive their entries, a
//! put is all or nothing, values over the size cap are never used.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise_cache::redis::RedisConfig;
use reprise_cache::semantic::{IndexConfig, SemanticIndex};
use reprise_cache::testing::RedisServer;
use reprise_cache::{ByKey, Store};

/// A store over a tier of `cfg` with a 3-dimensional index, as one replica.
async fn store(cfg: RedisConfig, replica: &str) -> Store {
    let redis = tier(cfg, replica).await;
    let index = Arc::new(SemanticIndex::new(3, IndexConfig::default()));
    Store::new(
        1 << 20,
        Duration::from_secs(60),
        Some(redis),
        Some(index),
        None,
    )
}

/// A candidate whose entry this replica does not hold keeps its vector while Redis cannot
/// say whether the entry exists; once Redis answers "absent", the vector is tombstoned.
#[tokio::test]
async fn a_redis_error_never_tombstones_a_candidate() {
    let mut server = RedisServer::start();
    let cfg = RedisConfig {
        breaker_cooldown_ms: 100,
        ..config(server.url())
    };
    let a = store(cfg.clone(), "a").await;
    let b = store(cfg, "b").await;
    let e = Arc::new(entry("ns", "hello", 60_000));
    a.insert(e.clone(), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();
    // B knows the vector (as from a replicated put whose entry memory then evicted).
    let index = b.index().unwrap();
    index.insert(e.partition, e.id, e.embedding.clone().unwrap());

    server.stop();
    for _ in 0..10 {
        assert!(b.fetch(e.id).await.is_none(), "Redis is down");
        assert!(index.contains(e.id), "an error is not an absence");
    }

    // Back (empty): Redis now answers that the entry is absent.
    server.restart();
    let mut gone = false;
    for _ in 0..100 {
        assert!(b.fetch(e.id).await.is_none());
        if !index.contains(e.id) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "a definite absence tombstones the vector");
}

/// A read of Redis that started before a deletion reached this replica (a key lookup's
/// promotion, a candidate fetch, a replicated put) does not bring the entry back.
#[tokio::test]
async fn a_deletion_wins_over_a_late_promotion() {
    let server = RedisServer::start();
    let a = store(config(server.url()), "a").await;
    let b = store(config(server.url()), "b").await;
    let e = Arc::new(entry("ns", "hello", 60_000));
    a.insert(e.clone(), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();

    // B read the entry from Redis (the read in flight) ...
    let read = b.redis().unwrap().get(e.id).await.unwrap().unwrap();
    // ... when the deletion event arrived and was applied ...
    b.remove_local(e.id).await;
    // ... and then the read's result would be installed.
    b.install(read).await;
    assert!(b.get(e.id).await.is_none(), "not back in memory");
    assert_eq!(b.indexed(), 0, "nor in the index");

    // Redis still holds it here (the deletion's own DEL has not been applied): a lookup by key
    // or by id does not promote it either.
    let (found, probe) = b.find(&digest(1), |_| true).await;
    assert!(matches!(found, ByKey::Absent), "{found:?}");
    assert_eq!(probe.redis, Some(false));
    assert!(b.fetch(e.id).await.is_none());
    assert!(b.get(e.id).await.is_none());
    assert_eq!(b.indexed(), 0);

    // Another entry is promoted as before.
    let f = Arc::new(entry("ns", "world", 60_000));
    a.insert(f.clone(), &[digest(2)]).await;
    a.redis().unwrap().flush().await.unwrap();
    let (found, _) = b.find(&digest(2), |_| true).await;
    assert_eq!(found.fresh().map(|x| x.id), Some(f.id));
}
