//! The store and the Redis tier under faults and races, against real `redis-server`
//! processes: a Redis that cannot answer never tombstones a semantic candidate, a deletion
//! wins over a promotion that read the entry before it, index sets outlive their entries (and
//! are never evicted before them; the sweep prunes them), a put is all or nothing, values
//! over the size cap are never used.

mod common;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use common::*;
use reprise_cache::entry::Refusal;
use reprise_cache::now_ms;
use reprise_cache::redis::{RedisConfig, ReplicationEvent, Swept};
use reprise_cache::semantic::{IndexConfig, SemanticIndex};
use reprise_cache::testing::RedisServer;
use reprise_cache::{ByKey, Origin, Store, ITEM_OVERHEAD};

/// A store over a tier of `cfg` with a 3-dimensional index, as one replica.
async fn store(cfg: RedisConfig, replica: &str) -> Store {
    let redis = tier(cfg, replica).await;
    let index = Arc::new(SemanticIndex::new(3, IndexConfig::default()));
    Store::new(
        1 << 20,
        Duration::from_secs(60),
        Duration::ZERO,
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

/// Writing back what a replica holds after Redis lost its data keeps within the write
/// queue's bytes (a batch of large answers overran it, and the writes past it were dropped
/// while the write-back said it was done): every entry goes back, but one too large for any
/// replica to read or for the write queue, which is left out without failing the rest.
#[tokio::test]
async fn a_write_back_keeps_within_the_write_queue() {
    let server = RedisServer::start();
    let cfg = RedisConfig {
        write_queue_bytes: 32 << 10,
        max_value_bytes: 64 << 10,
        ..config(server.url())
    };
    let a = store(cfg, "a").await;
    let redis = a.redis().unwrap().clone();
    let mut ids = Vec::new();
    for i in 0..40 {
        let e = entry("ns", &format!("{i} {}", "x".repeat(10 << 10)), 60_000);
        ids.push(e.id);
        a.install(e).await;
    }
    let huge = entry("ns", &"y".repeat(100 << 10), 60_000);
    // Within the value cap, but larger than the whole write queue.
    let over_queue = entry("ns", &"z".repeat(40 << 10), 60_000);
    let left_out = [huge.id, over_queue.id];
    a.install(huge).await;
    a.install(over_queue).await;
    assert_eq!(a.reseed().await.unwrap(), 40);
    assert!(redis.exists_many(&ids).await.unwrap().iter().all(|h| *h));
    assert_eq!(
        redis.exists_many(&left_out).await.unwrap(),
        vec![false, false]
    );
}

/// A refusal this replica holds that Redis's copy lacks (its update did not reach Redis)
/// still refuses: a key read from Redis leads to the entry, and the copy promoted (merged
/// with the one held here) refuses it; the entry's other keys still lead to it.
#[tokio::test]
async fn a_refusal_redis_lacks_still_refuses_here() {
    let server = RedisServer::start();
    let a = store(config(server.url()), "a").await;
    let e = Arc::new(entry("ns", "hello", 60_000));
    a.insert(e.clone(), &[digest(1), digest(2)]).await;
    a.redis().unwrap().flush().await.unwrap();
    let mut refused = (*e).clone();
    assert!(refused.refuse(Refusal {
        key: digest(1),
        around: None
    }));
    // In memory only, as when the update to Redis failed.
    a.replace(Arc::new(refused)).await;
    for _ in 0..2 {
        let (found, _) = a.find(&digest(1), |_| true).await;
        assert!(!matches!(found, ByKey::Fresh(_)), "{found:?}");
    }
    let many = a.find_many(&[digest(1), digest(2)], |_| true).await;
    assert!(many[0].is_none(), "refused");
    assert!(many[1].is_some(), "another key");
    let (found, _) = a.find(&digest(2), |_| true).await;
    assert!(matches!(found, ByKey::Fresh(_)), "{found:?}");
}

/// Waits until `events` is subscribed (its start position resolved, after whatever was
/// written before), which it is once it sees an event: `a` puts until it does.
async fn until_subscribed(
    a: &reprise_cache::redis::RedisTier,
    events: &mut reprise_cache::redis::ReplicationStream,
) {
    for i in 0..100 {
        a.put(&entry("ns", &format!("first{i}"), 60_000), &[]);
        a.flush().await.unwrap();
        let seen = tokio::time::timeout(Duration::from_millis(200), events.next()).await;
        if matches!(seen, Ok(Some(ReplicationEvent::Put { .. }))) {
            return;
        }
    }
    panic!("B never saw an event");
}

/// A reader that finds a gap on reconnecting delivers its resync even when the read right
/// after fails again (a second blip): a gap once seen is not forgotten, though the position
/// it moved to shows none any more.
#[tokio::test]
async fn a_resync_found_on_reconnecting_survives_a_failing_read() {
    let server = RedisServer::start();
    let mut c = raw(&server.url()).await;
    let acl = |rules: &[&str]| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg("reader").arg(rules);
        cmd
    };
    let _: () = acl(&["on", ">pw", "~*", "&*", "+@all"])
        .query_async(&mut c)
        .await
        .unwrap();
    let a = tier(config(server.url()), "a").await;
    let b = tier(
        config(format!("redis://reader:pw@127.0.0.1:{}", server.port())),
        "b",
    )
    .await;
    let mut b_events = b.subscribe(true);
    until_subscribed(&a, &mut b_events).await;
    // B's reads of the stream (a script) now fail; its position checks still answer.
    let _: () = acl(&["-eval", "-evalsha", "-eval_ro", "-evalsha_ro"])
        .query_async(&mut c)
        .await
        .unwrap();
    // Events B has not read, then trimmed away.
    a.put(&entry("ns", "unread", 60_000), &[]);
    a.flush().await.unwrap();
    let _: u64 = redis::cmd("XTRIM")
        .arg("reprise:events")
        .arg("MAXLEN")
        .arg(0)
        .query_async(&mut c)
        .await
        .unwrap();
    let told = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match b_events.next().await {
                Some(ReplicationEvent::Resync) => return true,
                Some(_) => continue,
                None => return false,
            }
        }
    })
    .await;
    assert_eq!(told, Ok(true), "B is told to resync");
}

/// A change that stops nothing (a prefetched answer's first use) is written over the copy
/// Redis holds, so no replica serves a first use again; one on an entry Redis no longer
/// holds (a dropped put, an eviction there) keeps it here. A change that stops something (a
/// refusal) on such an entry drops it here too: Redis losing it may be a delete.
#[tokio::test]
async fn a_first_use_reaches_redis_and_an_entry_redis_lost_is_kept() {
    let server = RedisServer::start();
    let a = store(config(server.url()), "a").await;
    let redis = a.redis().unwrap().clone();
    let mut e = entry("ns", "hello", 60_000);
    e.origin = Origin::Prefetch;
    let e = Arc::new(e);
    a.insert(e.clone(), &[digest(1)]).await;
    redis.flush().await.unwrap();
    let mut used = (*e).clone();
    used.origin = Origin::Live;
    a.update_kept(Arc::new(used)).await;
    let stored = redis.get(e.id).await.unwrap().unwrap();
    assert_eq!(stored.origin, Origin::Live, "recorded in Redis");

    let lost = Arc::new(entry("ns", "lost", 60_000));
    a.insert(lost.clone(), &[digest(2)]).await;
    redis.flush().await.unwrap();
    let mut c = raw(&server.url()).await;
    let _: () = redis::cmd("DEL")
        .arg(format!("reprise:e:{{{}}}", lost.id))
        .query_async(&mut c)
        .await
        .unwrap();
    a.update_kept(lost.clone()).await;
    assert!(a.get(lost.id).await.is_some(), "kept here");
    a.update(lost.clone()).await;
    assert!(
        a.get(lost.id).await.is_none(),
        "a refusal's change drops it"
    );
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

/// A reader that fell behind by more than the stream keeps (its consumer stalled while other
/// replicas kept writing) is told to resync on its next read, with no connection error to
/// give it away, rather than skipping the trimmed events (a delete among them).
#[tokio::test]
async fn a_reader_behind_the_trimmed_stream_is_told_to_resync() {
    let server = RedisServer::start();
    let a = tier(config(server.url()), "a").await;
    let b = tier(config(server.url()), "b").await;
    let mut b_events = b.subscribe(true);
    until_subscribed(&a, &mut b_events).await;

    // B's consumer stalls: its reader buffers what it can (1024 events, plus one read in
    // hand) and waits. 1,400 puts are more than that.
    for i in 0..1_400 {
        assert!(a.put(&entry("ns", &format!("p{i}"), 60_000), &[]));
    }
    a.flush().await.unwrap();
    // A delete B has not read, more puts, then the stream is trimmed past them all (as
    // writers' `MAXLEN` does once enough events followed).
    let victim = entry("ns", "victim", 60_000);
    a.put(&victim, &[]);
    a.flush().await.unwrap();
    assert!(a.delete(victim.id).await.unwrap());
    for i in 0..1_000 {
        assert!(a.put(&entry("ns", &format!("q{i}"), 60_000), &[]));
    }
    let last = entry("ns", "last", 60_000);
    a.put(&last, &[]);
    a.flush().await.unwrap();
    let mut c = raw(&server.url()).await;
    let trimmed: u64 = redis::cmd("XTRIM")
        .arg("reprise:events")
        .arg("MAXLEN")
        .arg(10)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(trimmed > 2_000, "{trimmed}");

    // B catches up: the delete is gone from the stream, so it must be told to resync (the
    // rebuild reads Redis as it is, without the victim) rather than read on past the gap.
    loop {
        match next_event(&mut b_events).await {
            ReplicationEvent::Resync => break,
            ReplicationEvent::Delete { id } if id == victim.id => {
                panic!("the delete was trimmed, it cannot be read")
            }
            ReplicationEvent::Put { id, .. } if id == last.id => {
                panic!("B read on past the trimmed events without a resync")
            }
            _ => {}
        }
    }
    // Events after the resync arrive as usual.
    let after = entry("ns", "after", 60_000);
    a.put(&after, &[]);
    a.flush().await.unwrap();
    loop {
        match next_event(&mut b_events).await {
            ReplicationEvent::Put { id, .. } if id == after.id => break,
            ReplicationEvent::Put { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// When a key expires (`PEXPIRETIME`, Unix milliseconds; -1 without expiry).
async fn expire_time(c: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME")
        .arg(key)
        .query_async(c)
        .await
        .unwrap()
}

/// Namespace and tag index sets never expire before their entries: they carry no TTL (one
/// an older version gave a TTL loses it with the next put), while the entries keep theirs.
#[tokio::test]
async fn index_sets_outlive_their_entries() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let tags = ["doc-1".to_string()];
    let mut c = raw(&server.url()).await;
    // A set as an older version left it: with a TTL.
    let _: () = redis::cmd("ZADD")
        .arg("reprise:ns:{ns}")
        .arg(now_ms() + 600_000)
        .arg("0123456789abcdef0123456789abcdef")
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("PEXPIRE")
        .arg("reprise:ns:{ns}")
        .arg(1_000)
        .query_async(&mut c)
        .await
        .unwrap();
    for e in [entry("ns", "short", 30_000), entry("ns", "long", 600_000)] {
        assert!(t.put_with_tags(&e, &[], &tags));
        t.flush().await.unwrap();
        assert!(expire_time(&mut c, &format!("reprise:e:{{{}}}", e.id)).await > 0);
        for set in ["reprise:ns:{ns}", "reprise:tag:{doc-1}"] {
            assert_eq!(expire_time(&mut c, set).await, -1, "{set} expires");
        }
    }
    // A delete's fence does not give one a TTL either.
    t.delete_tag("doc-1").await.unwrap();
    assert_eq!(expire_time(&mut c, "reprise:tag:{doc-1}").await, -1);
}

/// The sweep prunes the ids no longer kept (a minute past their score, for clocks that
/// differ) and ended fences from every index set, deletes the sets left empty, leaves kept
/// ids, running fences and foreign keys alone, and makes a set an older version gave a TTL
/// persistent.
#[tokio::test]
async fn the_sweep_prunes_index_sets_and_deletes_empty_ones() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let mut c = raw(&server.url()).await;
    let live = entry("busy", "kept", 600_000);
    assert!(t.put_with_tags(&live, &[], &["kept-tag".to_string()]));
    t.flush().await.unwrap();
    let now = now_ms();
    let old = |n: u8| format!("{:032x}", n);
    let zadd = |key: &str, score: u64, member: String| {
        redis::cmd("ZADD").arg(key).arg(score).arg(member).clone()
    };
    for cmd in [
        // Long gone ids beside the live one, and in sets of their own.
        zadd("reprise:ns:{busy}", now - 120_000, old(1)),
        zadd("reprise:ns:{idle}", now - 120_000, old(2)),
        zadd("reprise:tag:{idle-tag}", now - 3_600_000, old(3)),
        // No longer kept, but within the margin: stays.
        zadd("reprise:ns:{recent}", now - 1_000, old(4)),
        // A fence that has ended, and one still running.
        zadd("reprise:tag:{fenced}", now - 120_000, "fence".into()),
        zadd("reprise:tag:{fencing}", now + 600_000, "fence".into()),
    ] {
        let _: () = cmd.query_async(&mut c).await.unwrap();
    }
    let _: () = redis::cmd("PEXPIRE")
        .arg("reprise:ns:{recent}")
        .arg(600_000)
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("reprise:ns:{foreign}")
        .arg("not a set")
        .query_async(&mut c)
        .await
        .unwrap();

    let swept = t.sweep_indexes().await.unwrap();
    assert_eq!(
        swept,
        Swept {
            sets: 7,
            pruned: 4,
            deleted: 3
        }
    );
    let exists = |key: &'static str| redis::cmd("EXISTS").arg(key).clone();
    for (key, there) in [
        ("reprise:ns:{busy}", true),
        ("reprise:tag:{kept-tag}", true),
        ("reprise:ns:{idle}", false),
        ("reprise:tag:{idle-tag}", false),
        ("reprise:ns:{recent}", true),
        ("reprise:tag:{fenced}", false),
        ("reprise:tag:{fencing}", true),
        ("reprise:ns:{foreign}", true),
    ] {
        let n: u64 = exists(key).query_async(&mut c).await.unwrap();
        assert_eq!(n == 1, there, "{key}");
    }
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg("reprise:ns:{busy}")
        .arg(0)
        .arg(-1)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(members, vec![live.id.to_string()]);
    assert_eq!(expire_time(&mut c, "reprise:ns:{recent}").await, -1);
    // The live entry is still found by its namespace's delete.
    assert_eq!(t.delete_namespace("busy").await.unwrap(), 1);
}

/// Under the recommended `maxmemory-policy volatile-lru`, Redis evicts entries but never an
/// index set: every entry still in Redis once it has evicted is found by its namespace's
/// delete.
#[tokio::test]
async fn evictions_never_hide_an_entry_from_its_delete() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let mut c = raw(&server.url()).await;
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut c)
        .await
        .unwrap();
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    for (name, value) in [
        ("maxmemory", (used + (2 << 20)).to_string()),
        ("maxmemory-policy", "volatile-lru".to_string()),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    // One namespace per entry, so that each set is as cold as its entry.
    let padding = "x".repeat(1024);
    let mut ids = Vec::new();
    for i in 0..4000 {
        let e = entry(&format!("n{i}"), &format!("{i} {padding}"), 600_000);
        ids.push(e.id);
        t.put(&e, &[]);
        if i % 100 == 99 {
            t.flush().await.unwrap();
        }
    }
    t.flush().await.unwrap();
    let stats: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut c)
        .await
        .unwrap();
    let evicted: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("evicted_keys:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(evicted > 100, "Redis evicted {evicted} keys");
    let held = t.exists_many(&ids).await.unwrap();
    assert!(held.iter().any(|h| *h), "some entries are still held");
    for i in 0..ids.len() {
        t.delete_namespace(&format!("n{i}")).await.unwrap();
    }
    let left: Vec<usize> = t
        .exists_many(&ids)
        .await
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, h)| **h)
        .map(|(i, _)| i)
        .collect();
    assert!(
        left.is_empty(),
        "{} entries outlived their namespace's delete, first {:?}",
        left.len(),
        &left[..left.len().min(10)]
    );
}

/// A put whose index entry cannot be written (a foreign value under the tag's index key)
/// stores nothing: never an entry that a tag delete could not find.
#[tokio::test]
async fn a_put_is_all_or_nothing() {
    let server = RedisServer::start();
    let t = tier(config(server.url()), "a").await;
    let mut c = raw(&server.url()).await;
    let _: () = redis::cmd("SET")
        .arg("reprise:tag:{broken}")
        .arg("not a set")
        .query_async(&mut c)
        .await
        .unwrap();
    let e = entry("ns", "hello", 60_000);
    assert!(t.put_with_tags(&e, &[digest(1)], &["fine".into(), "broken".into()]));
    t.flush().await.unwrap();
    assert_eq!(
        t.get(e.id).await.unwrap(),
        None,
        "no entry without its index"
    );
    assert_eq!(t.get_by_key(&digest(1)).await.unwrap(), None);
    assert_eq!(t.health().dropped_writes, 1, "counted as dropped");
    let len: u64 = redis::cmd("XLEN")
        .arg("reprise:events")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(len, 0, "and no event announces it");

    // The same put with a usable tag is stored whole.
    assert!(t.put_with_tags(&e, &[digest(1)], &["fine".into()]));
    t.flush().await.unwrap();
    assert_eq!(
        t.get_by_key(&digest(1)).await.unwrap().map(|x| x.id),
        Some(e.id)
    );
    assert_eq!(t.delete_tag("fine").await.unwrap(), 1);
}

/// Values over `max_value_bytes` are never read: they are absent, and counted as skipped; a
/// key whose value is longer than an id is not read whole either.
#[tokio::test]
async fn values_over_the_size_cap_read_as_absent() {
    let server = RedisServer::start();
    let t = tier(
        RedisConfig {
            max_value_bytes: 4096,
            ..config(server.url())
        },
        "a",
    )
    .await;
    let small = entry("ns", "small", 60_000);
    let mut big = entry("ns", &"x".repeat(10_000), 60_000);
    big.prompt = "big".into();
    assert!(t.put(&small, &[digest(1)]));
    assert!(
        !t.put(&big, &[digest(2)]),
        "not written by a tier that would not read it"
    );
    t.flush().await.unwrap();
    // Written by a replica with a larger cap.
    let other = tier(config(server.url()), "b").await;
    assert!(other.put(&big, &[digest(2)]));
    other.flush().await.unwrap();
    let skipped = counter("reprise_redis_skipped_total");
    assert_eq!(t.get(small.id).await.unwrap().map(|e| e.id), Some(small.id));
    assert_eq!(t.get(big.id).await.unwrap(), None, "over the cap");
    assert_eq!(t.get_by_key(&digest(2)).await.unwrap(), None);
    assert!(counter("reprise_redis_skipped_total") >= skipped + 2);
    let scanned = t.scan_entries(|_| {}).await.unwrap();
    assert_eq!(scanned.len(), 1, "a scan skips it too");

    // Named values: read within the caller's cap; taken within the tier's (and spent
    // either way).
    assert!(t.put_blob("model", vec![b'm'; 100]));
    assert!(t.put_blob("record", vec![b'r'; 10_000]));
    t.flush().await.unwrap();
    assert_eq!(t.get_blob("model", 10).await.unwrap(), None);
    assert_eq!(
        t.get_blob("model", 100).await.unwrap(),
        Some(vec![b'm'; 100])
    );
    assert_eq!(
        t.take_blob("record", b"spent".to_vec()).await.unwrap(),
        None
    );
    assert_eq!(
        t.get_blob("record", 4096).await.unwrap(),
        Some(b"spent".to_vec())
    );
    assert_eq!(
        t.take_blob("model", b"spent".to_vec()).await.unwrap(),
        Some(vec![b'm'; 100])
    );

    // A key holding something longer than an id.
    let mut c = raw(&server.url()).await;
    let key = format!("reprise:k:{}", blake3::Hash::from(digest(3)).to_hex());
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(format!("{}{}", small.id, "y".repeat(1 << 20)))
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(t.get_by_key(&digest(3)).await.unwrap(), None);
}

/// The write queue is bounded by bytes as well as by count: while Redis does not take
/// writes, puts past the byte budget are dropped (and counted), never buffered.
#[tokio::test]
async fn the_write_queue_is_bounded_by_bytes() {
    let server = RedisServer::start();
    let mut cfg = config(server.url());
    cfg.timeout_ms = 10_000;
    cfg.write_queue_bytes = 64 * 1024;
    let t = tier(cfg, "a").await;
    t.flush().await.unwrap();
    let mut c = raw(&server.url()).await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3_000)
        .arg("WRITE")
        .query_async(&mut c)
        .await
        .unwrap();
    // The writer takes the first and waits for Redis; the rest queue behind it.
    let text = "x".repeat(4096);
    let entries: Vec<_> = (0..100).map(|_| entry("ns", &text, 60_000)).collect();
    let dropped_before = t.health().dropped_writes;
    let mut accepted = 0;
    for e in &entries {
        if t.put(e, &[]) {
            accepted += 1;
        }
        assert!(
            t.queued_bytes() <= 64 * 1024,
            "{} bytes queued",
            t.queued_bytes()
        );
    }
    assert!(
        accepted < 20,
        "{accepted} of 100 writes of 4 KiB queued in 64 KiB"
    );
    assert_eq!(t.health().dropped_writes - dropped_before, 100 - accepted);
    // Once Redis takes writes again, what was queued lands and the budget is free again.
    t.flush().await.unwrap();
    assert_eq!(t.queued_bytes(), 0);
    let mut landed = 0;
    for e in &entries {
        if t.get(e.id).await.unwrap().is_some() {
            landed += 1;
        }
    }
    assert_eq!(landed, accepted);
}

/// A rebuild streams entries from Redis page by page and stops once memory's budget is
/// loaded: the scan ends early (the keyspace is never read whole), and memory holds no more
/// than its capacity.
#[tokio::test]
async fn a_rebuild_streams_and_stops_at_the_memory_budget() {
    let server = RedisServer::start();
    let writer = tier(config(server.url()), "a").await;
    let n = 3_000;
    for i in 0..n {
        assert!(writer.put(&entry("ns", &format!("answer {i}"), 600_000), &[]));
    }
    writer.flush().await.unwrap();
    // A replica whose memory holds about a sixth of them (each weighs its bytes, moka's
    // bookkeeping and the index's charge for its vector).
    let index = Arc::new(SemanticIndex::new(3, IndexConfig::default()));
    let one = u64::from(entry("ns", "answer 1000", 600_000).weight())
        + u64::from(ITEM_OVERHEAD)
        + u64::from(index.charge());
    let capacity = one * 500;
    let redis = tier(config(server.url()), "b").await;
    let store = Store::new(
        capacity,
        Duration::from_secs(60),
        Duration::ZERO,
        Some(redis.clone()),
        Some(index),
        None,
    );
    let (pages, receive) = tokio::sync::mpsc::channel(2);
    let (sent, loaded) = tokio::join!(
        redis.scan_pages(pages, |_| {}),
        store.load_pages(receive, |_| {})
    );
    let sent = sent.unwrap();
    assert!(loaded.stopped_at_budget);
    assert!(loaded.entries <= 520 && loaded.entries > 300, "{loaded:?}");
    // The scan stopped a few pages after the loader did, not at the end of the keyspace.
    assert!(sent < n, "scanned {sent} of {n}");
    store.run_pending_tasks().await;
    assert!(store.weighted_size() <= capacity);
}

/// A rebuild that stops at the budget still gives the entries this replica holds the
/// refusals their Redis copies have (a question reported wrong on another replica while
/// this one held the entry is not served it again here); it reads the whole keyspace for
/// that.
#[tokio::test]
async fn a_rebuild_stopped_at_the_budget_still_merges_refusals_into_held_entries() {
    let server = RedisServer::start();
    let writer = tier(config(server.url()), "a").await;
    let n = 2_000;
    for i in 0..n {
        assert!(writer.put(&entry("ns", &format!("answer {i}"), 600_000), &[]));
    }
    writer.flush().await.unwrap();
    let one = u64::from(entry("ns", "answer 1000", 600_000).weight()) + u64::from(ITEM_OVERHEAD);
    let redis = tier(config(server.url()), "b").await;
    let store = Store::new(
        one * 40,
        Duration::from_secs(60),
        Duration::ZERO,
        Some(redis.clone()),
        None,
        None,
    );
    let held = entry("ns", "held here", 600_000);
    store.insert(Arc::new(held.clone()), &[digest(1)]).await;
    redis.flush().await.unwrap();
    // Another replica refuses a question to it.
    let mut refused = held.clone();
    refused.refuse(reprise_cache::entry::Refusal {
        key: digest(7),
        around: None,
    });
    assert_eq!(
        writer.update(&refused).await.unwrap(),
        reprise_cache::redis::Updated::Written
    );
    let (pages, receive) = tokio::sync::mpsc::channel(2);
    let (sent, loaded) = tokio::join!(
        redis.scan_pages(pages, |_| {}),
        store.load_pages(receive, |_| {})
    );
    assert!(loaded.stopped_at_budget, "{loaded:?}");
    assert_eq!(sent.unwrap(), n + 1, "the whole keyspace read");
    let got = store.get(held.id).await.expect("still held");
    assert_eq!(got.refusals.len(), 1, "the refusal taken");
}

/// A namespace delete whose entry deletes fail midway leaves the ids of that round in the
/// index set (put back), so the delete asked again finds them: taken out of the set and
/// left undeleted, they would outlive every later delete.
#[tokio::test]
async fn a_failed_delete_round_puts_its_ids_back() {
    let server = RedisServer::start();
    let writer = tier(config(server.url()), "a").await;
    let entries: Vec<_> = (0..3)
        .map(|i| entry("docs", &format!("answer {i}"), 600_000))
        .collect();
    for e in &entries {
        assert!(writer.put(e, &[]));
    }
    writer.flush().await.unwrap();
    // A user that may do everything but delete keys.
    let mut admin = raw(&server.url()).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("nodel")
        .arg("on")
        .arg("nopass")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-del")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = server.url().replacen("redis://", "redis://nodel:any@", 1);
    let cfg = RedisConfig {
        breaker_failures: 1000,
        ..config(url)
    };
    let limited = tier(cfg, "b").await;
    assert!(limited.delete_namespace("docs").await.is_err());
    // Every entry is still there, and still in the set: a full delete reaches them all.
    for e in &entries {
        assert!(writer.get(e.id).await.unwrap().is_some());
    }
    assert_eq!(writer.delete_namespace("docs").await.unwrap(), 3);
    for e in &entries {
        assert_eq!(writer.get(e.id).await.unwrap(), None);
    }
}
