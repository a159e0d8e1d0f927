//! The Redis tier against real `redis-server` processes (one per test, on free ports):
//! round trips, expiry, replication events between replicas, the shared policies' versions,
//! foreign values, outages and recovery through the circuit breaker, invalidation, full scans,
//! and a 3-master cluster.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use reprise_cache::redis::{PolicyPublish, RedisConfig, RedisError, ReplicationEvent};
use reprise_cache::testing::{RedisCluster, RedisServer};
use reprise_cache::{Entry, EntryId};

#[tokio::test]
async fn put_get_and_alias_round_trip() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let e = entry("ns", "hello", 60_000);
    assert!(t.put(&e, &[digest(1), digest(2)]));
    t.flush().await.unwrap();

    assert_eq!(t.get_by_key(&digest(1)).await.unwrap().as_ref(), Some(&e));
    assert_eq!(t.get_by_key(&digest(2)).await.unwrap().as_ref(), Some(&e));
    assert_eq!(t.get(e.id).await.unwrap().as_ref(), Some(&e));
    assert_eq!(t.get_by_key(&digest(3)).await.unwrap(), None);
    assert_eq!(t.get(EntryId::random()).await.unwrap(), None);

    assert!(t.alias(digest(3), e.id, Duration::from_secs(60)));
    t.flush().await.unwrap();
    assert_eq!(t.get_by_key(&digest(3)).await.unwrap().unwrap().id, e.id);

    // The stored layout: a versioned envelope under the entry key, the id under the key,
    // both expiring with the entry.
    let mut c = raw(&server.url()).await;
    let stored: String = redis::cmd("GET")
        .arg(format!("reprise:e:{{{}}}", e.id))
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(stored.starts_with(r#"{"v":1,"entry":{"#), "{stored}");
    let key = format!("reprise:k:{}", blake3::Hash::from(digest(1)).to_hex());
    let id: String = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(id, e.id.to_string());
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 60_000, "{pttl}");
    let h = t.health();
    assert!(h.up && !h.breaker_open);
    assert_eq!(h.dropped_writes, 0);
}

#[tokio::test]
async fn entries_expire_with_their_ttl() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let short = entry("ns", "short", 400);
    let long = entry("ns", "long", 60_000);
    t.put(&short, &[digest(1)]);
    t.put(&long, &[digest(2)]);
    t.flush().await.unwrap();
    assert!(t.get(short.id).await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(t.get(short.id).await.unwrap(), None);
    assert_eq!(t.get_by_key(&digest(1)).await.unwrap(), None);
    assert!(t.get_by_key(&digest(2)).await.unwrap().is_some());

    // An already expired entry is not written at all.
    let dead = entry("ns", "dead", 0);
    assert!(!t.put(&dead, &[digest(9)]));
}

#[tokio::test]
async fn events_reach_other_replicas_but_not_their_writer() {
    let server = RedisServer::start();
    let a = tier(config(server.url()), "replica-a").await;
    let b = tier(config(server.url()), "replica-b").await;
    // From the start of the (empty) stream, so nothing written below can be missed.
    let mut b_events = b.subscribe(false);
    let mut a_events = a.subscribe(false);

    let from_b = entry("ns-b", "by b", 60_000);
    b.put(&from_b, &[digest(1)]);
    b.flush().await.unwrap();
    let from_a = entry("ns-a", "by a", 60_000);
    a.put(&from_a, &[digest(2)]);
    a.flush().await.unwrap();
    assert!(a.delete(from_a.id).await.unwrap());
    assert_eq!(a.delete_namespace("ns-a").await.unwrap(), 0);
    assert_eq!(a.delete_tag("release-1").await.unwrap(), 0);

    // B sees A's four events in order, never its own put.
    assert_eq!(
        next_event(&mut b_events).await,
        ReplicationEvent::Put {
            id: from_a.id,
            namespace: "ns-a".into()
        }
    );
    assert_eq!(
        next_event(&mut b_events).await,
        ReplicationEvent::Delete { id: from_a.id }
    );
    assert_eq!(
        next_event(&mut b_events).await,
        ReplicationEvent::DeleteNamespace {
            namespace: "ns-a".into()
        }
    );
    assert_eq!(
        next_event(&mut b_events).await,
        ReplicationEvent::DeleteTag {
            tag: "release-1".into()
        }
    );
    // A sees only B's put.
    assert_eq!(
        next_event(&mut a_events).await,
        ReplicationEvent::Put {
            id: from_b.id,
            namespace: "ns-b".into()
        }
    );
    // And the entry named in an event can be fetched by the reader.
    assert_eq!(a.get(from_b.id).await.unwrap().unwrap().text, "by b");

    // Nothing else is pending for either (B's own put was filtered out).
    let b_more = tokio::time::timeout(Duration::from_millis(1500), b_events.next()).await;
    assert!(b_more.is_err(), "unexpected event for b: {b_more:?}");
    let a_more = tokio::time::timeout(Duration::from_millis(300), a_events.next()).await;
    assert!(a_more.is_err(), "unexpected event for a: {a_more:?}");
}

/// A subscription from now has its start resolved when it returns: an event written right
/// after (before its reader task ever ran) is delivered, an older one is not. A replica's
/// start-up scan begins after it subscribes, so no delete written during or after the scan
/// is skipped.
#[tokio::test]
async fn a_subscription_from_now_misses_nothing_written_after_it() {
    let server = RedisServer::start();
    let b = tier(config(server.url()), "replica-b").await;
    let mut c = raw(&server.url()).await;
    let xadd = |id: u128| {
        redis::cmd("XADD")
            .arg("reprise:events")
            .arg("*")
            .arg("op")
            .arg("del")
            .arg("id")
            .arg(format!("{id:032x}"))
            .arg("ns")
            .arg("")
            .arg("origin")
            .arg("replica-a")
            .clone()
    };
    let _: String = xadd(1).query_async(&mut c).await.unwrap();
    let mut events = b.subscribe_from_now().await;
    // Written at once, on a connection already open, before the reader task could run.
    let _: String = xadd(2).query_async(&mut c).await.unwrap();
    assert_eq!(
        next_event(&mut events).await,
        ReplicationEvent::Delete { id: EntryId(2) }
    );
}

/// A reader that had read no event yet when Redis restarted empty asks for a resync too: it
/// cannot tell a wiped Redis from one that never held a stream.
#[tokio::test]
async fn a_restart_before_any_event_asks_for_a_resync() {
    let mut server = RedisServer::start();
    let cfg = RedisConfig {
        breaker_cooldown_ms: 200,
        ..config(server.url())
    };
    let b = tier(cfg, "b").await;
    let mut b_events = b.subscribe(true);
    // Connected and waiting on the (absent) stream.
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.restart();
    assert_eq!(next_event(&mut b_events).await, ReplicationEvent::Resync);
}

#[tokio::test]
async fn a_restart_that_loses_events_asks_for_a_resync() {
    let mut server = RedisServer::start();
    let cfg = RedisConfig {
        breaker_cooldown_ms: 200,
        ..config(server.url())
    };
    let a = tier(cfg.clone(), "a").await;
    let b = tier(cfg, "b").await;
    let mut b_events = b.subscribe(false);
    let first = entry("ns", "one", 60_000);
    a.put(&first, &[]);
    a.flush().await.unwrap();
    assert!(matches!(
        next_event(&mut b_events).await,
        ReplicationEvent::Put { id, .. } if id == first.id
    ));

    // Redis restarts empty: the stream B was reading is gone.
    server.restart();
    assert_eq!(next_event(&mut b_events).await, ReplicationEvent::Resync);

    // Events written after the restart still arrive.
    let second = entry("ns", "two", 60_000);
    let mut delivered = false;
    for _ in 0..50 {
        if a.put(&second, &[])
            && a.flush().await.is_ok()
            && a.get(second.id).await.is_ok_and(|e| e.is_some())
        {
            delivered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(delivered, "a could not write after the restart");
    loop {
        match next_event(&mut b_events).await {
            ReplicationEvent::Put { id, .. } if id == second.id => break,
            // A retried put may be seen twice; anything else is a bug.
            ReplicationEvent::Put { .. } | ReplicationEvent::Resync => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn foreign_and_corrupt_values_are_skipped_and_counted() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let good = entry("ns", "good", 60_000);
    t.put(&good, &[digest(1)]);
    t.flush().await.unwrap();

    let mut c = raw(&server.url()).await;
    let garbage = EntryId::random();
    let future = EntryId::random();
    let wrong_type = EntryId::random();
    let mismatched = EntryId::random();
    let set = |key: String, value: String| redis::cmd("SET").arg(key).arg(value).clone();
    let cmds = [
        set(
            format!("reprise:e:{{{garbage}}}"),
            "\u{0}not json at all".into(),
        ),
        set(
            format!("reprise:e:{{{future}}}"),
            r#"{"v":2,"entry":{"whatever":true}}"#.into(),
        ),
        // A valid envelope stored under another id's key.
        set(
            format!("reprise:e:{{{mismatched}}}"),
            format!(
                r#"{{"v":1,"entry":{}}}"#,
                serde_json::to_string(&good).unwrap()
            ),
        ),
        set(
            format!("reprise:k:{}", blake3::Hash::from(digest(2)).to_hex()),
            "not an id".into(),
        ),
        set(
            format!("reprise:k:{}", blake3::Hash::from(digest(3)).to_hex()),
            garbage.to_string(),
        ),
        set("reprise:e:not-even-an-id".into(), "x".into()),
        redis::cmd("RPUSH")
            .arg(format!("reprise:e:{{{wrong_type}}}"))
            .arg("x")
            .clone(),
    ];
    for cmd in &cmds {
        let _: () = cmd.query_async(&mut c).await.unwrap();
    }

    let before = counter("reprise_redis_skipped_total");
    for id in [garbage, future, wrong_type, mismatched] {
        assert_eq!(t.get(id).await.unwrap(), None, "{id}");
    }
    assert_eq!(t.get_by_key(&digest(2)).await.unwrap(), None);
    assert_eq!(t.get_by_key(&digest(3)).await.unwrap(), None);
    assert!(counter("reprise_redis_skipped_total") >= before + 6);

    // A scan returns the good entry only.
    let all = t.scan_entries(|_| {}).await.unwrap();
    assert_eq!(all, vec![good.clone()]);
    assert!(counter("reprise_redis_skipped_total") >= before + 11);
    assert!(t.health().up);
}

/// Named hashes: each writer replaces its own field, the hash lives for the given time, and
/// reads are capped (values over `max_value_bytes`, fields past the bound, foreign keys).
#[tokio::test]
async fn hash_fields_round_trip_with_their_lifetime_and_caps() {
    let server = RedisServer::start();
    let mut cfg = config(server.url());
    cfg.max_value_bytes = 100;
    let t = tier(cfg, "a").await;
    let ttl = Duration::from_secs(60);
    assert!(t.put_field("stats:1", "replica-a", b"one".to_vec(), ttl));
    assert!(t.put_field("stats:1", "replica-b", b"two".to_vec(), ttl));
    assert!(t.put_field("stats:1", "replica-a", b"three".to_vec(), ttl));
    assert!(t.put_field("stats:1", "big", vec![b'x'; 101], ttl));
    assert!(t.put_field("stats:2", "replica-a", b"four".to_vec(), ttl));
    for f in ["a", "b", "c"] {
        assert!(t.put_field("stats:3", f, b"v".to_vec(), ttl));
    }
    t.flush().await.unwrap();

    let mut c = raw(&server.url()).await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg("reprise:hash:{stats:1}")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 60_000, "{pttl}");
    let _: () = redis::cmd("SET")
        .arg("reprise:hash:{foreign}")
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();

    let before = counter("reprise_redis_skipped_total");
    let names: Vec<String> = ["stats:1", "stats:2", "stats:absent", "foreign"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut got = t.get_fields(&names, 10).await.unwrap();
    got[0].sort();
    let field = |f: &str, v: &[u8]| (f.to_string(), v.to_vec());
    assert_eq!(
        got,
        vec![
            vec![field("replica-a", b"three"), field("replica-b", b"two")],
            vec![field("replica-a", b"four")],
            vec![],
            vec![],
        ]
    );
    assert!(counter("reprise_redis_skipped_total") >= before + 2);
    // At most `max_fields` fields of one hash.
    let three = ["stats:3".to_string()];
    assert_eq!(t.get_fields(&three, 2).await.unwrap()[0].len(), 2);
    // More hashes than one round reads.
    let many: Vec<String> = (0..70).map(|i| format!("stats:{}", i % 3)).collect();
    let got = t.get_fields(&many, 10).await.unwrap();
    assert_eq!(got.len(), 70);
    // stats:2, in the first round and in the last.
    assert_eq!(got[2], vec![field("replica-a", b"four")]);
    assert_eq!(got[68], got[2]);
    assert!(got[0].is_empty() && got[69].is_empty());
}

#[tokio::test]
async fn an_outage_opens_the_breaker_and_recovery_closes_it() {
    let mut server = RedisServer::start();
    let cfg = RedisConfig {
        breaker_failures: 3,
        breaker_cooldown_ms: 1000,
        ..config(server.url())
    };
    let t = tier(cfg, "a").await;
    let e = entry("ns", "before", 600_000);
    t.put(&e, &[digest(1)]);
    t.flush().await.unwrap();
    assert!(t.get_by_key(&digest(1)).await.unwrap().is_some());

    server.stop();
    // Failures first (each bounded by the command timeout), then fast failures without
    // trying Redis at all.
    let mut unavailable = 0;
    for _ in 0..20 {
        match t.get(e.id).await {
            Err(RedisError::Unavailable) => unavailable += 1,
            Err(_) => {}
            Ok(v) => panic!("redis is down, got {v:?}"),
        }
    }
    assert!(
        unavailable >= 15,
        "breaker should open after 3 failures: {unavailable}"
    );
    let h = t.health();
    assert!(h.breaker_open && !h.up, "{h:?}");

    // Writes are dropped and counted, never buffered while the breaker is open.
    let dropped = h.dropped_writes;
    assert!(!t.put(&entry("ns", "lost", 60_000), &[digest(2)]));
    assert!(!t.alias(digest(3), e.id, Duration::from_secs(60)));
    assert_eq!(t.health().dropped_writes, dropped + 2);
    assert!(matches!(t.delete(e.id).await, Err(RedisError::Unavailable)));

    // Redis comes back on the same port, empty: the same tier serves again after the
    // cooldown, without being recreated.
    server.restart();
    let after = entry("ns", "after", 60_000);
    let mut recovered = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if t.get(after.id).await.is_ok() {
            recovered = true;
            break;
        }
    }
    assert!(recovered, "the tier did not recover");
    assert!(t.put(&after, &[digest(4)]));
    t.flush().await.unwrap();
    assert_eq!(t.get_by_key(&digest(4)).await.unwrap(), Some(after));
    let h = t.health();
    assert!(h.up && !h.breaker_open, "{h:?}");
}

#[tokio::test]
async fn redis_down_at_start_is_not_fatal() {
    let mut server = RedisServer::start();
    server.stop();
    let cfg = RedisConfig {
        breaker_failures: 1,
        breaker_cooldown_ms: 200,
        ..config(server.url())
    };
    let t = tier(cfg, "a").await;
    assert!(t.get(EntryId::random()).await.is_err());
    server.restart();
    let e = entry("ns", "late", 60_000);
    let mut stored = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if t.put(&e, &[digest(1)]) && t.flush().await.is_ok() {
            if let Ok(Some(got)) = t.get_by_key(&digest(1)).await {
                assert_eq!(got, e);
                stored = true;
                break;
            }
        }
    }
    assert!(stored);
}

/// The shared policies: each stored version is above every earlier one and above the
/// publisher's own; a publication based on an outdated version is refused with the newer
/// one; other replicas are told, the publisher is not.
#[tokio::test]
async fn policy_versions_only_grow_and_stale_publications_are_refused() {
    let server = RedisServer::start();
    let a = tier(config(server.url()), "replica-a").await;
    let b = tier(config(server.url()), "replica-b").await;
    let mut a_events = a.subscribe(false);
    let mut b_events = b.subscribe(false);
    assert_eq!(b.get_policies().await.unwrap(), None);

    // Nothing stored yet: stored as the version asked for.
    assert_eq!(
        a.publish_policies(Some(0), 2, b"one").await.unwrap(),
        PolicyPublish::Stored(2)
    );
    // B still builds on nothing: refused, told the newer version; nothing changes.
    assert_eq!(
        b.publish_policies(Some(0), 2, b"stale").await.unwrap(),
        PolicyPublish::Behind(2)
    );
    let stored = b.get_policies().await.unwrap().unwrap();
    assert_eq!((stored.version, stored.doc.as_slice()), (2, &b"one"[..]));
    // Built on version 2: stored as 3.
    assert_eq!(
        b.publish_policies(Some(2), 3, b"two").await.unwrap(),
        PolicyPublish::Stored(3)
    );
    // A replica whose own version ran ahead (changes it could not share) stores above it.
    assert_eq!(
        a.publish_policies(Some(3), 10, b"three").await.unwrap(),
        PolicyPublish::Stored(10)
    );
    // Without a base: stored whatever is there, if above it; never at or below it.
    assert_eq!(
        b.publish_policies(None, 10, b"same").await.unwrap(),
        PolicyPublish::Behind(10)
    );
    assert_eq!(
        b.publish_policies(None, 11, b"four").await.unwrap(),
        PolicyPublish::Stored(11)
    );
    let stored = a.get_policies().await.unwrap().unwrap();
    assert_eq!((stored.version, stored.doc.as_slice()), (11, &b"four"[..]));

    // Each replica hears of the other's versions only.
    assert_eq!(
        next_event(&mut b_events).await,
        ReplicationEvent::Policies { version: 2 }
    );
    assert_eq!(
        next_event(&mut b_events).await,
        ReplicationEvent::Policies { version: 10 }
    );
    assert_eq!(
        next_event(&mut a_events).await,
        ReplicationEvent::Policies { version: 3 }
    );
    assert_eq!(
        next_event(&mut a_events).await,
        ReplicationEvent::Policies { version: 11 }
    );
    // The layout: one hash.
    let mut c = raw(&server.url()).await;
    let version: String = redis::cmd("HGET")
        .arg("reprise:policies")
        .arg("version")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(version, "11");
}

/// The shared policy document is read only within `max_value_bytes`: a larger one, a value
/// that is not a hash, or a version that is not a number reads as none and is counted.
#[tokio::test]
async fn shared_policies_are_read_within_the_cap_and_validated() {
    let server = RedisServer::start();
    let a = tier(config(server.url()), "replica-a").await;
    let mut small = config(server.url());
    small.max_value_bytes = 100;
    let b = tier(small, "replica-b").await;
    assert_eq!(
        a.publish_policies(Some(0), 2, &[b'x'; 100]).await.unwrap(),
        PolicyPublish::Stored(2)
    );
    assert_eq!(b.get_policies().await.unwrap().unwrap().doc.len(), 100);
    assert_eq!(
        a.publish_policies(Some(2), 3, &[b'y'; 101]).await.unwrap(),
        PolicyPublish::Stored(3)
    );
    let before = counter("reprise_redis_skipped_total");
    assert_eq!(b.get_policies().await.unwrap(), None, "over the cap");
    assert!(counter("reprise_redis_skipped_total") > before);
    assert_eq!(a.get_policies().await.unwrap().unwrap().version, 3);

    let mut c = raw(&server.url()).await;
    let _: () = redis::cmd("HSET")
        .arg("reprise:policies")
        .arg("version")
        .arg("three")
        .query_async(&mut c)
        .await
        .unwrap();
    let before = counter("reprise_redis_skipped_total");
    assert_eq!(a.get_policies().await.unwrap(), None, "not a number");
    assert!(counter("reprise_redis_skipped_total") > before);
    let _: () = redis::cmd("DEL")
        .arg("reprise:policies")
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("reprise:policies")
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();
    let before = counter("reprise_redis_skipped_total");
    assert_eq!(a.get_policies().await.unwrap(), None, "not a hash");
    assert!(counter("reprise_redis_skipped_total") > before);
    assert!(a.health().up);
}

#[tokio::test]
async fn delete_namespace_and_tag_invalidation() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let a: Vec<Entry> = (0..3)
        .map(|i| entry("a", &format!("a{i}"), 60_000))
        .collect();
    let b: Vec<Entry> = (0..2)
        .map(|i| entry("b", &format!("b{i}"), 60_000))
        .collect();
    for (i, e) in a.iter().chain(&b).enumerate() {
        t.put(e, &[digest(i as u32)]);
    }
    t.flush().await.unwrap();

    assert!(t.delete(a[0].id).await.unwrap());
    assert!(!t.delete(a[0].id).await.unwrap());
    assert_eq!(t.get(a[0].id).await.unwrap(), None);
    assert_eq!(t.get_by_key(&digest(0)).await.unwrap(), None);

    assert_eq!(t.delete_namespace("a").await.unwrap(), 2);
    for (i, e) in a.iter().enumerate() {
        assert_eq!(t.get(e.id).await.unwrap(), None);
        assert_eq!(t.get_by_key(&digest(i as u32)).await.unwrap(), None);
    }
    for e in &b {
        assert!(t.get(e.id).await.unwrap().is_some());
    }
    assert_eq!(t.delete_namespace("a").await.unwrap(), 0);

    // A delete is applied after the writes queued before it: no resurrection.
    let late = entry("b", "late", 60_000);
    t.put(&late, &[]);
    assert_eq!(t.delete_namespace("b").await.unwrap(), 3);
    assert_eq!(t.get(late.id).await.unwrap(), None);

    let tagged: Vec<Entry> = (0..2)
        .map(|i| entry("c", &format!("t{i}"), 60_000))
        .collect();
    let other = entry("c", "untagged", 60_000);
    for e in &tagged {
        t.put_with_tags(e, &[], &["doc-1".to_string()]);
    }
    t.put_with_tags(&other, &[], &["doc-2".to_string()]);
    assert_eq!(t.delete_tag("doc-1").await.unwrap(), 2);
    for e in &tagged {
        assert_eq!(t.get(e.id).await.unwrap(), None);
    }
    assert!(t.get(other.id).await.unwrap().is_some());
}

#[tokio::test]
async fn scan_finds_every_live_entry() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let n = 1_234;
    let mut ids = std::collections::HashSet::new();
    for i in 0..n {
        let e = entry(&format!("ns{}", i % 7), &format!("text {i}"), 60_000);
        ids.insert(e.id);
        // Queue capacity is 10 000, so nothing is dropped.
        assert!(t.put(&e, &[digest(i)]));
    }
    // Something under another prefix is not ours.
    let other = tier(
        RedisConfig {
            prefix: "other".into(),
            ..config(server.url())
        },
        "x",
    )
    .await;
    other.put(&entry("ns", "elsewhere", 60_000), &[]);
    other.flush().await.unwrap();
    t.flush().await.unwrap();

    let calls = AtomicUsize::new(0);
    let last = AtomicUsize::new(0);
    let all = t
        .scan_entries(|count| {
            calls.fetch_add(1, Ordering::Relaxed);
            last.store(count, Ordering::Relaxed);
        })
        .await
        .unwrap();
    assert_eq!(all.len(), n as usize);
    assert_eq!(
        all.iter()
            .map(|e| e.id)
            .collect::<std::collections::HashSet<_>>(),
        ids
    );
    assert!(calls.load(Ordering::Relaxed) > 1);
    assert_eq!(last.load(Ordering::Relaxed), n as usize);
}

#[tokio::test]
async fn cluster_round_trip() {
    let cluster = RedisCluster::start(3);
    let cfg = RedisConfig {
        cluster_urls: cluster.urls(),
        // A fresh cluster may still be settling on the first commands.
        timeout_ms: 1000,
        ..RedisConfig::default()
    };
    let t = tier(cfg.clone(), "a").await;
    let b = tier(cfg, "b").await;
    let mut b_events = b.subscribe(false);

    let entries: Vec<Entry> = (0..60)
        .map(|i| entry(&format!("ns{}", i % 3), &format!("c{i}"), 60_000))
        .collect();
    for (i, e) in entries.iter().enumerate() {
        assert!(t.put(e, &[digest(i as u32)]));
    }
    t.flush().await.unwrap();
    assert_eq!(t.health().dropped_writes, 0);
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(
            t.get_by_key(&digest(i as u32)).await.unwrap().as_ref(),
            Some(e)
        );
    }
    t.alias(digest(1000), entries[5].id, Duration::from_secs(60));
    t.flush().await.unwrap();
    assert_eq!(
        t.get_by_key(&digest(1000)).await.unwrap().unwrap().id,
        entries[5].id
    );

    // Entries are spread over every master, and the scan visits them all.
    let all = b.scan_entries(|_| {}).await.unwrap();
    assert_eq!(all.len(), entries.len());
    for node in cluster.nodes() {
        let mut c = raw(&node.url()).await;
        let keys: u64 = redis::cmd("DBSIZE").query_async(&mut c).await.unwrap();
        assert!(keys > 0, "node {} holds nothing", node.port());
    }

    assert!(matches!(
        next_event(&mut b_events).await,
        ReplicationEvent::Put { .. }
    ));
    // An update writes over a held entry only, merged with the refusals it holds (its
    // script touches one key, so it runs on a cluster).
    assert!(t.delete(entries[1].id).await.unwrap());
    assert_eq!(
        t.update(&entries[1]).await.unwrap(),
        reprise_cache::redis::Updated::Gone,
        "stays deleted"
    );
    assert_eq!(t.get(entries[1].id).await.unwrap(), None);
    let (mut first, mut second) = (entries[2].clone(), entries[2].clone());
    first.refuse(refusal(9001));
    second.refuse(refusal(9002));
    use reprise_cache::redis::Updated;
    assert_eq!(t.update(&first).await.unwrap(), Updated::Written);
    assert_eq!(t.update(&second).await.unwrap(), Updated::Written);
    let held = t.get(entries[2].id).await.unwrap().unwrap();
    assert_eq!(held.refusals.len(), 2, "neither refusal lost");
    // A put of the deleted entry (another replica's, queued when it was deleted) is refused
    // by its mark, in the entry's slot.
    assert!(b.put(&entries[1], &[digest(3000)]));
    b.flush().await.unwrap();
    assert_eq!(t.get(entries[1].id).await.unwrap(), None);
    assert_eq!(t.delete_namespace("ns0").await.unwrap(), 20);
    // ns0's 20 and the one deleted above are gone.
    assert_eq!(b.scan_entries(|_| {}).await.unwrap().len(), 39);
    // An answer generated before the delete, written after it, is refused by the fence
    // (the sets and the entry live on different masters here).
    let mut late = entry("ns0", "late", 60_000);
    late.gen_ms = 5_000;
    assert!(b.put_with_tags(&late, &[digest(2000)], &["t".into()]));
    b.flush().await.unwrap();
    assert_eq!(t.get(late.id).await.unwrap(), None);
    assert_eq!(t.get_by_key(&digest(2000)).await.unwrap(), None);
    // The sweep visits every master's index sets (ns1, ns2, ns0 with its fence, and the
    // tag set the refused put wrote before its fenced namespace set refused it: an id
    // leading nowhere, pruned once it is no longer kept), and leaves them whole.
    let swept = t.sweep_indexes().await.unwrap();
    assert_eq!(
        (swept.sets, swept.pruned, swept.deleted),
        (4, 0, 0),
        "{swept:?}"
    );
    assert_eq!(
        t.delete_namespace("ns1").await.unwrap(),
        19,
        "less the one deleted above"
    );

    // The policies' script touches one key, so it runs on a cluster.
    assert_eq!(
        t.publish_policies(Some(0), 2, b"doc").await.unwrap(),
        PolicyPublish::Stored(2)
    );
    assert_eq!(b.get_policies().await.unwrap().unwrap().doc, b"doc");
    // So does the script that takes a value.
    t.put_blob_for("response:x", b"record".to_vec(), Duration::from_secs(60));
    assert_eq!(
        t.take_blob("response:x", b"spent".to_vec()).await.unwrap(),
        Some(b"record".to_vec())
    );
    assert_eq!(
        t.take_blob("response:x", b"spent".to_vec()).await.unwrap(),
        Some(b"spent".to_vec())
    );
    assert_eq!(
        t.take_blob("response:none", b"spent".to_vec())
            .await
            .unwrap(),
        None
    );
}

/// Two stores over one Redis, as two replicas: what one writes, the other finds by key and by
/// id through Redis and promotes into its memory and index; an alias reaches Redis too; a
/// deletion reaches every tier.
#[tokio::test]
async fn a_store_promotes_what_another_replica_wrote() {
    use reprise_cache::{ByKey, Probe};

    let server = RedisServer::start();
    let store = |name| replica(&server, name, Some(3), Duration::ZERO);
    let (a, b) = (store("a").await, store("b").await);
    let e = Arc::new(entry("ns", "hello", 60_000));
    a.insert(e.clone(), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();

    // B: a miss in memory, a hit in Redis, promoted.
    let (found, probe) = b.find(&digest(1), |_| true).await;
    assert_eq!(found.fresh().map(|f| f.id), Some(e.id));
    assert_eq!(
        probe,
        Probe {
            memory: false,
            redis: Some(true)
        }
    );
    assert_eq!(
        b.get(e.id).await.map(|f| f.id),
        Some(e.id),
        "now in B's memory"
    );
    assert_eq!(b.indexed(), 1, "and in B's index");
    let (_, probe) = b.find(&digest(1), |_| true).await;
    assert_eq!(
        probe,
        Probe {
            memory: true,
            redis: None
        },
        "an L1 hit next time"
    );
    // Too old for the caller in every tier: stale, not absent.
    let (found, _) = b.find(&digest(1), |_| false).await;
    assert!(matches!(found, ByKey::Stale));

    // By id (a semantic candidate): another entry A wrote is fetched from Redis.
    let f = Arc::new(entry("ns", "world", 60_000));
    a.insert(f.clone(), &[digest(2)]).await;
    a.redis().unwrap().flush().await.unwrap();
    assert_eq!(b.fetch(f.id).await.map(|x| x.id), Some(f.id));

    // An alias B writes reaches Redis, so A finds the entry by it.
    b.alias(digest(3), &f).await;
    b.redis().unwrap().flush().await.unwrap();
    let (found, probe) = a.find(&digest(3), |_| true).await;
    assert_eq!(found.fresh().map(|x| x.id), Some(f.id));
    assert_eq!(probe.redis, Some(true));

    // A deletion from B removes it from Redis; A's own copy goes with replication (not
    // running here), so only B's memory and Redis are checked.
    assert!(b.delete(f.id).await.unwrap());
    assert!(b.get(f.id).await.is_none());
    assert_eq!(a.redis().unwrap().get(f.id).await.unwrap(), None);

    // A changed copy A writes of the entry B deleted (a refusal, before B's event reached
    // A) does not bring it back.
    let mut refused = (*f).clone();
    refused.refuse(refusal(7000));
    a.update(Arc::new(refused)).await;
    assert_eq!(
        a.redis().unwrap().get(f.id).await.unwrap(),
        None,
        "stays deleted"
    );
    // A and B each refuse a question to an entry both hold, neither having heard of the
    // other's (replication is not running): Redis keeps both refusals.
    let (mut on_a, mut on_b) = ((*e).clone(), (*e).clone());
    on_a.refuse(refusal(7001));
    on_b.refuse(refusal(7002));
    a.update(Arc::new(on_a)).await;
    b.update(Arc::new(on_b)).await;
    let held = a.redis().unwrap().get(e.id).await.unwrap().expect("held");
    let keys: Vec<_> = held.refusals.iter().map(|r| r.key).collect();
    assert_eq!(keys.len(), 2, "neither refusal lost");
    assert!(keys.contains(&digest(7001)) && keys.contains(&digest(7002)));

    // An answer deleted by its id while it was generated (the id is announced first) is
    // not stored when its generation ends.
    let g = Arc::new(entry("ns", "late", 60_000));
    b.delete(g.id).await.unwrap();
    b.insert(g.clone(), &[digest(4)]).await;
    b.redis().unwrap().flush().await.unwrap();
    assert!(b.get(g.id).await.is_none());
    assert_eq!(b.redis().unwrap().get(g.id).await.unwrap(), None);
    assert!(matches!(
        b.find(&digest(4), |_| true).await.0,
        ByKey::Absent
    ));
}

/// A scan reads values a megabyte at a time at most, whatever a `SCAN` page holds: entries
/// of 300 KB come four or fewer a page, and a single larger one alone.
#[tokio::test]
async fn a_scan_holds_about_a_megabyte_of_values_at_once() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let mut ids = std::collections::HashSet::new();
    for i in 0..10 {
        let e = entry("ns", &format!("{i}{}", "x".repeat(300_000)), 60_000);
        ids.insert(e.id);
        assert!(t.put(&e, &[digest(100 + i)]));
    }
    let big = entry("ns", &"y".repeat(1_500_000), 60_000);
    ids.insert(big.id);
    assert!(t.put(&big, &[digest(99)]));
    t.flush().await.unwrap();

    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let sent = t.scan_pages(tx, |_| {}).await.unwrap();
    let mut seen = std::collections::HashSet::new();
    while let Some(page) = rx.recv().await {
        let bytes: usize = page.iter().map(|e| e.text.len()).sum();
        assert!(
            page.len() == 1 || bytes <= 1 << 20,
            "{} entries, {bytes} bytes in one page",
            page.len()
        );
        seen.extend(page.iter().map(|e| e.id));
    }
    assert_eq!(sent, 11);
    assert_eq!(seen, ids, "every entry, once");
}

/// An entry larger than any replica would read back is not written (counted as a dropped
/// write): it would cost the queue and Redis, and every other replica would miss on it.
#[tokio::test]
async fn an_entry_over_the_read_cap_is_not_written() {
    let server = RedisServer::start();
    let t = tier(
        RedisConfig {
            max_value_bytes: 2048,
            ..config(server.url())
        },
        "a",
    )
    .await;
    let small = entry("ns", "short", 60_000);
    let large = entry("ns", &"x".repeat(4096), 60_000);
    assert!(t.put(&small, &[digest(1)]));
    assert!(!t.put(&large, &[digest(2)]));
    t.flush().await.unwrap();
    assert!(t.get(small.id).await.unwrap().is_some());
    let mut c = raw(&server.url()).await;
    let exists: u32 = redis::cmd("EXISTS")
        .arg(format!("reprise:e:{{{}}}", large.id))
        .arg(format!(
            "reprise:k:{}",
            blake3::Hash::from(digest(2)).to_hex()
        ))
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(exists, 0, "neither the entry nor its key");
    assert_eq!(t.health().dropped_writes, 1);
}

/// An answer renewed on a replica that never held the old one (the old one only in Redis)
/// takes the old one's refusals from Redis, here and in Redis.
#[tokio::test]
async fn a_renewal_takes_refusals_the_old_answer_has_in_redis_only() {
    let server = RedisServer::start();
    let store = |name| replica(&server, name, Some(3), Duration::ZERO);
    let (a, b) = (store("a").await, store("b").await);
    let old = entry("ns", "old answer", 60_000);
    a.insert(Arc::new(old.clone()), &[digest(1)]).await;
    let mut refused = old.clone();
    refused.refuse(refusal(2));
    a.update(Arc::new(refused)).await;
    a.redis().unwrap().flush().await.unwrap();

    assert!(b.get(old.id).await.is_none(), "B never held the old answer");
    let new = entry("ns", "new answer", 60_000);
    b.insert(Arc::new(new.clone()), &[digest(1)]).await;
    b.repoint(old.id, &new).await;
    assert!(
        b.get(new.id).await.unwrap().refuses_key(&digest(2)),
        "the refusal carries over on B"
    );
    b.redis().unwrap().flush().await.unwrap();
    let shared = a
        .redis()
        .unwrap()
        .get(new.id)
        .await
        .unwrap()
        .expect("in redis");
    assert!(shared.refuses_key(&digest(2)), "and in Redis");
}

/// With a retention, an expired entry stays in Redis (entry, key, index entries) for it: a
/// second store that never held it finds it by key as `Expired`, never as fresh, and no other
/// read hands it out (by id as a candidate, in a batch of turn links, a rebuild's load); a
/// namespace delete still reaches it. Past the retention it is gone.
#[tokio::test]
async fn expired_entries_are_kept_for_the_retention_and_never_fresh() {
    use reprise_cache::ByKey;

    let server = RedisServer::start();
    let store = |name| replica(&server, name, Some(3), Duration::from_millis(1500));
    let a = store("a").await;
    let e = Arc::new(entry("ns", "soon stale", 300));
    let f = Arc::new(entry("other", "also stale", 300));
    a.insert(e.clone(), &[digest(1)]).await;
    a.insert(f.clone(), &[digest(2)]).await;
    a.redis().unwrap().flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let b = store("b").await;
    let (found, probe) = b.find(&digest(1), |_| true).await;
    match found {
        ByKey::Expired(kept) => assert_eq!(kept.id, e.id),
        other => panic!("expected the kept entry, got {other:?}"),
    }
    assert_eq!(probe.redis, Some(false), "not a fresh hit");
    assert!(b.get(e.id).await.is_none(), "not promoted into memory");
    assert!(b.fetch(e.id).await.is_none(), "no semantic candidate");
    assert_eq!(b.find_many(&[digest(1)], |_| true).await, vec![None]);
    let (pages, receive) = tokio::sync::mpsc::channel(2);
    let redis = b.redis().unwrap().clone();
    let (_, loaded) = tokio::join!(
        redis.scan_pages(pages, |_| {}),
        b.load_pages(receive, |_| {})
    );
    assert_eq!(loaded.entries, 0, "a rebuild loads no expired entry");
    // The memory of the writer keeps it too, as expired.
    assert!(matches!(
        a.find(&digest(1), |_| true).await.0,
        ByKey::Expired(_)
    ));

    // A namespace delete reaches a kept entry.
    assert_eq!(b.delete_namespace("other").await.unwrap(), 1);
    assert!(matches!(
        b.find(&digest(2), |_| true).await.0,
        ByKey::Absent
    ));

    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(matches!(
        b.find(&digest(1), |_| true).await.0,
        ByKey::Absent
    ));
    assert_eq!(b.redis().unwrap().get(e.id).await.unwrap(), None);
}

/// A filtered delete (the admin API's by tenant, model, age or a tenant's tag) reaches the
/// entries only Redis keeps, not just those the deleting replica holds: B never held A's
/// entries, and deletes those of one namespace among them, in Redis and its memory alike.
#[tokio::test]
async fn a_filtered_delete_reaches_entries_only_redis_keeps() {
    use reprise_cache::ByKey;

    let server = RedisServer::start();
    let store = |name| replica(&server, name, None, Duration::ZERO);
    let (a, b) = (store("a").await, store("b").await);
    let mut ids = Vec::new();
    for i in 0..30u32 {
        let e = Arc::new(entry(&format!("ns{}", i % 3), &format!("text {i}"), 60_000));
        ids.push((e.id, e.namespace.clone()));
        a.insert(e, &[digest(i)]).await;
    }
    a.redis().unwrap().flush().await.unwrap();
    // B holds one of ns0's itself (found by key), the rest only Redis has.
    assert!(matches!(
        b.find(&digest(0), |_| true).await.0,
        ByKey::Fresh(_)
    ));
    b.run_pending_tasks().await;
    assert_eq!(b.entry_count(), 1);

    let deleted = b.delete_where(|e| e.namespace == "ns0").await.unwrap();
    assert_eq!(deleted, 10);
    let redis = b.redis().unwrap();
    for (id, ns) in &ids {
        let kept = redis.get(*id).await.unwrap().is_some();
        assert_eq!(kept, ns != "ns0", "{ns}");
    }
    assert!(b.get(ids[0].0).await.is_none());
}

/// A namespace or tag delete wins over answers that were being generated when it happened:
/// one whose generation started before it is neither stored nor installed from Redis (where
/// another replica, not yet told of the delete, wrote it); one started after is.
#[tokio::test]
async fn deletes_win_over_answers_generated_across_them() {
    use reprise_cache::ByKey;

    let server = RedisServer::start();
    let store = |name| replica(&server, name, None, Duration::ZERO);
    let (a, b) = (store("a").await, store("b").await);
    // Answers that took 5 s to generate, stored now: they started before the deletes below.
    let slow = |ns: &str, text: &str, tags: &[&str]| {
        let mut e = entry(ns, text, 60_000);
        e.gen_ms = 5_000;
        e.tags = tags.iter().map(|t| t.to_string()).collect();
        Arc::new(e)
    };
    a.delete_namespace("docs").await.unwrap();
    a.delete_tag("release-1").await.unwrap();
    let in_ns = slow("docs", "old manual", &[]);
    let tagged = slow("other", "old notes", &["release-1"]);
    a.insert(in_ns.clone(), &[digest(1)]).await;
    a.insert(tagged.clone(), &[digest(2)]).await;
    a.redis().unwrap().flush().await.unwrap();
    assert!(a.get(in_ns.id).await.is_none() && a.get(tagged.id).await.is_none());
    assert_eq!(a.redis().unwrap().get(in_ns.id).await.unwrap(), None);

    // B generated one across A's namespace delete and wrote it before the delete's event
    // reached it; once fenced (the event), B drops it and A never installs it from Redis.
    let across = slow("docs", "old faq", &[]);
    let tagged_across = slow("elsewhere", "old notes", &["release-1"]);
    b.insert(across.clone(), &[digest(3)]).await;
    b.insert(tagged_across.clone(), &[digest(5)]).await;
    b.redis().unwrap().flush().await.unwrap();
    assert!(matches!(
        a.find(&digest(3), |_| true).await.0,
        ByKey::Absent
    ));
    // Redis refused both puts (the deletes fenced their sets), so no replica, nor one that
    // starts later and reads Redis, ever gets them.
    let shared = a.redis().unwrap();
    assert_eq!(shared.get(across.id).await.unwrap(), None);
    assert_eq!(shared.get(tagged_across.id).await.unwrap(), None);
    assert_eq!(shared.get_by_key(&digest(5)).await.unwrap(), None);
    b.remove_local_namespace("docs").await;
    assert!(matches!(
        b.find(&digest(3), |_| true).await.0,
        ByKey::Absent
    ));

    // An answer generated after the deletes (a later millisecond) is stored as ever, on
    // either replica and in Redis; the fences leave the sets' later deletes working.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let fresh = Arc::new(entry("docs", "new manual", 60_000));
    a.insert(fresh.clone(), &[digest(4)]).await;
    assert_eq!(a.get(fresh.id).await.map(|e| e.id), Some(fresh.id));
    let mut fresh_tagged = entry("elsewhere", "new notes", 60_000);
    fresh_tagged.tags = vec!["release-1".into()];
    b.insert(Arc::new(fresh_tagged.clone()), &[digest(6)]).await;
    b.redis().unwrap().flush().await.unwrap();
    assert_eq!(
        shared.get(fresh.id).await.unwrap().map(|e| e.id),
        Some(fresh.id)
    );
    let held = shared.get(fresh_tagged.id).await.unwrap();
    assert_eq!(held.map(|e| e.id), Some(fresh_tagged.id));
    b.delete_tag("release-1").await.unwrap();
    a.delete_namespace("docs").await.unwrap();
    assert_eq!(shared.get(fresh.id).await.unwrap(), None);
    assert_eq!(shared.get(fresh_tagged.id).await.unwrap(), None);
}

/// An entry deleted by id before another replica's put of it reached Redis (a client may
/// delete an answer by the id it was announced with while it still streams) is never
/// written back: the delete marks the id, and the put is refused.
#[tokio::test]
async fn a_deleted_id_is_never_written_back() {
    use reprise_cache::ByKey;

    let server = RedisServer::start();
    let store = |name| replica(&server, name, None, Duration::ZERO);
    let (a, b) = (store("a").await, store("b").await);
    let mut events = a.redis().unwrap().subscribe(false);
    let x = Arc::new(entry("docs", "streamed", 60_000));
    assert!(!a.delete(x.id).await.unwrap(), "nothing held yet");
    b.insert(x.clone(), &[digest(1)]).await;
    b.redis().unwrap().flush().await.unwrap();
    assert_eq!(a.redis().unwrap().get(x.id).await.unwrap(), None);
    // The refusal is announced as a delete of no replica's, so the replica that generated
    // it drops its copy too (A reads it: its own delete's event it skips).
    match next_event(&mut events).await {
        ReplicationEvent::Delete { id } => assert_eq!(id, x.id),
        other => panic!("{other:?}"),
    }

    // A replica that starts later does not find it either.
    let c = store("c").await;
    assert!(matches!(
        c.find(&digest(1), |_| true).await.0,
        ByKey::Absent
    ));
    // Another entry is written as ever.
    let y = Arc::new(entry("docs", "kept", 60_000));
    b.insert(y.clone(), &[digest(2)]).await;
    b.redis().unwrap().flush().await.unwrap();
    assert!(a.redis().unwrap().get(y.id).await.unwrap().is_some());
}

/// Keys read in one batch (a conversation's turns) never lead to an entry this replica
/// deleted: it is neither served nor linked, like a single key's read.
#[tokio::test]
async fn a_batched_read_skips_what_this_replica_deleted() {
    let server = RedisServer::start();
    let a = replica(&server, "a", None, Duration::ZERO).await;
    let x = Arc::new(entry("docs", "turn", 60_000));
    a.insert(x.clone(), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();
    // Removed here only (say, another replica's delete event): Redis still has it.
    a.remove_local(x.id).await;
    assert!(a.redis().unwrap().get(x.id).await.unwrap().is_some());
    let found = a.find_many(&[digest(1)], |_| true).await;
    assert!(found[0].is_none(), "deleted here");
    assert!(a.get(x.id).await.is_none());
}

/// A changed copy (a refusal added) of an entry another replica deleted meanwhile is not put
/// back: the replica drops it too, so its keys do not serve it again.
#[tokio::test]
async fn an_update_of_an_entry_deleted_elsewhere_drops_it() {
    let server = RedisServer::start();
    let (a, b) = (
        replica(&server, "a", None, Duration::ZERO).await,
        replica(&server, "b", None, Duration::ZERO).await,
    );
    let e = Arc::new(entry("ns", "an answer", 60_000));
    a.insert(e.clone(), &[digest(1)]).await;
    a.redis().unwrap().flush().await.unwrap();
    assert!(b.delete(e.id).await.unwrap());
    a.update(e.clone()).await;
    let (found, _) = a.find(&digest(1), |_| true).await;
    assert!(found.fresh().is_none(), "the deleted entry came back");
}

/// An alias to a key no answer claims yet does not overwrite, in Redis, an answer another
/// replica holds for it (that replica's answer was generated for the key), but takes a key
/// whose answer is gone.
#[tokio::test]
async fn an_unclaimed_alias_leaves_another_replicas_answer_in_place() {
    let server = RedisServer::start();
    let store = |name| replica(&server, name, None, Duration::ZERO);
    let (a, b, c) = (store("a").await, store("b").await, store("c").await);
    // B answered the key itself.
    let own = Arc::new(entry("ns", "B's own answer", 60_000));
    b.insert(own.clone(), &[digest(9)]).await;
    b.redis().unwrap().flush().await.unwrap();
    // A, which never saw it, aliases the key to its prefetched answer.
    let prefetched = Arc::new(entry("ns", "A's prefetched answer", 60_000));
    a.insert(prefetched.clone(), &[digest(8)]).await;
    a.alias_unclaimed(&[digest(9), digest(10)], &prefetched)
        .await;
    a.redis().unwrap().flush().await.unwrap();
    // A third replica reads Redis: the key leads to B's answer; the unclaimed one to A's.
    let (found, _) = c.find(&digest(9), |_| true).await;
    assert_eq!(found.fresh().map(|e| e.id), Some(own.id));
    let (found, _) = c.find(&digest(10), |_| true).await;
    assert_eq!(found.fresh().map(|e| e.id), Some(prefetched.id));
    // Once B's answer is deleted its key leads nowhere: an unclaimed alias (from a replica
    // that holds nothing under the key) takes it.
    assert!(b.delete(own.id).await.unwrap());
    let (d, e) = (store("d").await, store("e").await);
    d.alias_unclaimed(&[digest(9)], &prefetched).await;
    d.redis().unwrap().flush().await.unwrap();
    let (found, _) = e.find(&digest(9), |_| true).await;
    assert_eq!(found.fresh().map(|e| e.id), Some(prefetched.id));
}

/// A tag fenced within a namespace prefix (a tenant's tag delete) refuses, in Redis, a put
/// of an answer with the tag in such a namespace generated before the fence (a put queued
/// on another replica, or an answer generated across the delete), on a single server and on
/// a cluster (the fences live in the tag set's slot). Another prefix's answer with the tag,
/// the prefix's answers without it, and answers generated after the fence are stored.
#[tokio::test]
async fn a_tag_fenced_within_a_prefix_refuses_only_that_prefixs_earlier_answers() {
    let server = RedisServer::start();
    tag_fenced_within(config(server.url())).await;
    let cluster = RedisCluster::start(3);
    tag_fenced_within(RedisConfig {
        cluster_urls: cluster.urls(),
        timeout_ms: 1000,
        ..RedisConfig::default()
    })
    .await;
}

async fn tag_fenced_within(cfg: RedisConfig) {
    let (a, b) = (tier(cfg.clone(), "a").await, tier(cfg, "b").await);
    a.announce_tag_within("acme/", "pricing").await.unwrap();
    // A tag whose set key hashes whole on a cluster (it starts with `}`): its fences live
    // in another slot and are read apart.
    a.announce_tag_within("acme/", "}odd").await.unwrap();
    // Answers that took 5 s to generate, written now: they started before the fence.
    let late = |ns: &str, text: &str, tags: &[&str]| {
        let mut e = entry(ns, text, 60_000);
        e.gen_ms = 5_000;
        e.tags = tags.iter().map(|t| t.to_string()).collect();
        e
    };
    let fenced = late("acme/docs", "old price", &["faq", "pricing"]);
    let other_tenant = late("beta/docs", "beta price", &["pricing"]);
    let other_tag = late("acme/docs", "old faq", &["faq"]);
    // A namespace that only starts like the prefix's tenant name is another tenant's.
    let lookalike = late("acme-corp/docs", "their price", &["pricing"]);
    let odd = late("acme/docs", "odd one", &["}odd"]);
    let odd_other_tenant = late("beta/docs", "their odd one", &["}odd", "pricing"]);
    let all = [
        &fenced,
        &other_tenant,
        &other_tag,
        &lookalike,
        &odd,
        &odd_other_tenant,
    ];
    for (i, e) in all.into_iter().enumerate() {
        assert!(b.put_with_tags(e, &[digest(7_000 + i as u32)], &e.tags));
    }
    b.flush().await.unwrap();
    assert_eq!(b.health().dropped_writes, 0);
    for e in [&fenced, &odd] {
        assert_eq!(
            a.get(e.id).await.unwrap(),
            None,
            "{} refused by the fence",
            e.text
        );
    }
    assert_eq!(a.get_by_key(&digest(7_000)).await.unwrap(), None);
    for e in [&other_tenant, &other_tag, &lookalike, &odd_other_tenant] {
        assert_eq!(a.get(e.id).await.unwrap().as_ref(), Some(e), "{}", e.text);
    }
    // Generated after the fence (a later millisecond): stored as ever.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut fresh = entry("acme/docs", "new price", 60_000);
    fresh.tags = vec!["pricing".into()];
    assert!(b.put_with_tags(&fresh, &[digest(7_010)], &fresh.tags));
    b.flush().await.unwrap();
    assert_eq!(a.get(fresh.id).await.unwrap().as_ref(), Some(&fresh));
}
