//! The store's unit tests.

use super::*;
use crate::entry::{now_ms, Origin};
use crate::semantic::IndexConfig;

fn store() -> Store {
    store_of(1 << 20, SemanticIndex::new(2, IndexConfig::default()))
}

/// A store of `bytes` of memory over `index`.
fn store_of(bytes: u64, index: SemanticIndex) -> Store {
    Store::new(
        bytes,
        Duration::from_secs(60),
        Duration::ZERO,
        None,
        Some(Arc::new(index)),
        None,
    )
}

fn entry(text: &str, created_ms: u64) -> Entry {
    Entry {
        id: EntryId::random(),
        namespace: "ns".into(),
        model: "m".into(),
        text: text.into(),
        finish_reason: "stop".into(),
        prompt_tokens: 1,
        completion_tokens: 1,
        prompt: text.into(),
        partition: [9; 32],
        embedding: Some(vec![1.0, 0.0].into()),
        embedder: None,
        origin: Origin::Live,
        tags: vec!["t".into()],
        refusals: Vec::new(),
        created_ms,
        expires_ms: now_ms() + 60_000,
        gen_ms: 0,
    }
}

#[tokio::test]
async fn insert_reaches_the_entry_by_every_key_and_by_meaning() {
    let s = store();
    let e = Arc::new(entry("a", now_ms()));
    s.insert(e.clone(), &[[1; 32], [2; 32]]).await;
    for k in [[1; 32], [2; 32]] {
        let (found, probe) = s.find(&k, |_| true).await;
        assert_eq!(found.fresh().map(|f| f.id), Some(e.id));
        assert_eq!(
            probe,
            Probe {
                memory: true,
                redis: None
            }
        );
    }
    assert!(matches!(s.find(&[3; 32], |_| true).await.0, ByKey::Absent));
    assert!(matches!(s.find(&[1; 32], |_| false).await.0, ByKey::Stale));
    let c = s.search(&[9; 32], &[1.0, 0.0], 1);
    assert_eq!(c.first().map(|c| c.id), Some(e.id));
}

/// A renewed answer takes the keys that led to the old one, but not a key the old one
/// refused (a question reported wrong), and it refuses what the old one refused.
#[tokio::test]
async fn a_renewed_answer_keeps_the_refusals_of_the_old_one() {
    let s = store();
    let old = entry("a", now_ms());
    s.insert(Arc::new(old.clone()), &[[1; 32], [2; 32]]).await;
    let mut refused = old.clone();
    refused.refuse(crate::entry::Refusal {
        key: [2; 32],
        around: None,
    });
    s.update(Arc::new(refused)).await;
    let new = entry("a", now_ms());
    s.insert(Arc::new(new.clone()), &[]).await;
    s.repoint(old.id, &new).await;
    let by = |k| s.get_by_key(k);
    assert_eq!(by(&[1; 32]).await.map(|e| e.id), Some(new.id), "repointed");
    assert!(
        by(&[2; 32]).await.is_none_or(|e| e.id != new.id),
        "the refused question is not led to the renewed answer"
    );
    let held = s.get(new.id).await.unwrap();
    assert!(held.refuses_key(&[2; 32]), "the refusal carries over");

    // With no key left to move (the renewed answer took its own already), the
    // refusals carry over all the same.
    let lone = entry("b", now_ms());
    s.insert(Arc::new(lone.clone()), &[]).await;
    let mut refused = lone.clone();
    refused.refuse(crate::entry::Refusal {
        key: [3; 32],
        around: None,
    });
    s.update(Arc::new(refused)).await;
    let renewed = entry("b", now_ms());
    s.insert(Arc::new(renewed.clone()), &[]).await;
    s.repoint(lone.id, &renewed).await;
    assert!(s.get(renewed.id).await.unwrap().refuses_key(&[3; 32]));
}

/// The deleted ids remembered weigh within their budget: past it the oldest are
/// forgotten, the newest kept.
#[tokio::test]
async fn remembered_deletes_stay_within_their_byte_budget() {
    let s = store();
    let budget = deleted_budget(1 << 20);
    let room = budget / u64::from(crate::ITEM_OVERHEAD);
    let ids: Vec<EntryId> = (0..room * 3).map(|_| EntryId::random()).collect();
    for id in &ids {
        s.remove_local(*id).await;
    }
    s.deleted.run_pending_tasks();
    assert!(s.deleted.weighted_size() <= budget, "within the budget");
    assert!(s.deleted.entry_count() >= room / 2, "the budget is used");
    assert!(s.was_deleted(*ids.last().unwrap()), "the newest is kept");
    assert!(!s.was_deleted(ids[0]), "the oldest is forgotten");
}

/// A copy read before a delete or a verdict (a hit's entry, relinked after the answer)
/// never brings the entry back nor drops the refusal given meanwhile.
#[tokio::test]
async fn a_copy_read_earlier_never_undoes_a_delete_or_a_refusal() {
    let s = store();
    let e = Arc::new(entry("a", now_ms()));
    s.insert(e.clone(), &[[1; 32]]).await;
    let read = s.get_by_key(&[1; 32]).await.unwrap();
    // A verdict meanwhile: the held copy gains a refusal.
    let mut refused = (*read).clone();
    refused.refuse(crate::entry::Refusal {
        key: [5; 32],
        around: None,
    });
    s.update(Arc::new(refused)).await;
    let mut relinked = (*read).clone();
    relinked.origin = Origin::Live;
    relinked.gen_ms = 7;
    s.replace(Arc::new(relinked)).await;
    let held = s.get_by_key(&[1; 32]).await.unwrap();
    assert_eq!(held.gen_ms, 7, "the change is taken");
    assert!(held.refuses_key(&[5; 32]), "the refusal is kept");
    // Deleted meanwhile: the earlier copy does not bring it back.
    s.remove_local(e.id).await;
    s.replace(read.clone()).await;
    assert!(!s.memory.holds(e.id));
    assert!(s.get_by_key(&[1; 32]).await.is_none());
    // Nor do the refusals of a copy another replica sent.
    let mut other = (*read).clone();
    other.refuse(crate::entry::Refusal {
        key: [6; 32],
        around: None,
    });
    assert!(s
        .merge_refusals(read.clone(), &other)
        .await
        .refuses_key(&[6; 32]));
    assert!(!s.memory.holds(e.id));
    // Nor a delete by tag.
    let t = Arc::new(entry("b", now_ms()));
    s.insert(t.clone(), &[[2; 32]]).await;
    let read = s.get_by_key(&[2; 32]).await.unwrap();
    s.fence_tag("t");
    s.remove_local(t.id).await;
    s.replace(read).await;
    assert!(s.get_by_key(&[2; 32]).await.is_none());
}

#[tokio::test]
async fn aliases_move_and_unclaimed_ones_only() {
    let s = store();
    let a = Arc::new(entry("a", now_ms()));
    let b = Arc::new(entry("b", now_ms()));
    s.insert(a.clone(), &[[1; 32]]).await;
    s.insert(b.clone(), &[[2; 32]]).await;
    // [2] is claimed by b already, [3] is new.
    s.alias_unclaimed(&[[2; 32], [3; 32]], &a).await;
    assert_eq!(s.get_by_key(&[2; 32]).await.unwrap().id, b.id);
    assert_eq!(s.get_by_key(&[3; 32]).await.unwrap().id, a.id);
    // Every key of a follows a renewed entry.
    let renewed = Arc::new(entry("a2", now_ms()));
    s.insert(renewed.clone(), &[[4; 32]]).await;
    s.repoint(a.id, &renewed).await;
    for k in [[1; 32], [3; 32], [4; 32]] {
        assert_eq!(s.get_by_key(&k).await.unwrap().id, renewed.id);
    }
    assert_eq!(s.get_by_key(&[2; 32]).await.unwrap().id, b.id);
}

#[tokio::test]
async fn removal_tombstones_and_a_vanished_candidate_is_forgotten() {
    let s = store();
    let a = Arc::new(entry("a", now_ms()));
    let b = Arc::new(entry("b", now_ms()));
    s.insert(a.clone(), &[[1; 32]]).await;
    s.insert(b.clone(), &[[2; 32]]).await;
    assert_eq!(s.indexed(), 2);
    s.remove_local(a.id).await;
    assert_eq!(s.indexed(), 1);
    assert!(s.get_by_key(&[1; 32]).await.is_none());
    // A vector whose entry no tier holds (gone behind the index's back): fetching it
    // tombstones the vector.
    let ghost = EntryId::random();
    s.index()
        .unwrap()
        .insert([9; 32], ghost, vec![0.0, 1.0].into());
    assert!(s.fetch(ghost).await.is_none());
    assert!(!s.index().unwrap().contains(ghost));
    assert_eq!(s.fetch(b.id).await.map(|e| e.id), Some(b.id));
    let c = Arc::new(entry("c", now_ms()));
    s.insert(c.clone(), &[]).await;
    assert_eq!(s.delete_tag("t").await.unwrap(), 2, "b and c");
    assert!(s.get(c.id).await.is_none());
}

#[tokio::test]
async fn installs_and_loads_skip_what_is_held_or_expired() {
    let s = store();
    let a = entry("a", now_ms());
    let held = s.install(a.clone()).await;
    assert_eq!(held.id, a.id);
    let mut changed = a.clone();
    changed.text = "other".into();
    assert_eq!(s.install(changed).await.text, "a", "the held copy wins");
    let mut expired = entry("x", now_ms());
    expired.expires_ms = 1;
    let b = entry("b", now_ms());
    let loaded = s
        .load(
            vec![a.clone(), expired, b.clone()],
            vec![([5; 32], b.id)],
            |_| {},
        )
        .await;
    assert_eq!(
        loaded,
        Loaded {
            entries: 1,
            vectors: 1,
            keys: 1,
            stopped_at_budget: false,
        }
    );
    assert_eq!(s.get_by_key(&[5; 32]).await.unwrap().id, b.id);
    assert_eq!(s.indexed(), 2);
    // A key of an entry the load did not keep is not loaded.
    let loaded = s.load(vec![], vec![([6; 32], EntryId(42))], |_| {}).await;
    assert_eq!(loaded.keys, 0);
    assert!(s.keys().iter().all(|(k, _)| *k != [6; 32]));
}

#[tokio::test]
async fn only_vectors_of_the_index_embedder_are_indexed() {
    let index = SemanticIndex::new(2, IndexConfig::default()).for_embedder([1; 32]);
    let s = store_of(1 << 20, index);
    let made_by = |fingerprint: Option<[u8; 32]>| {
        let mut e = entry("answer", now_ms());
        e.embedder = fingerprint;
        e
    };
    let (ours, older, other) = (
        made_by(Some([1; 32])),
        made_by(None),
        made_by(Some([2; 32])),
    );
    s.install(ours.clone()).await;
    s.load(vec![older.clone(), other.clone()], vec![], |_| {})
        .await;
    let found: Vec<EntryId> = s
        .search(&[9; 32], &[1.0, 0.0], 10)
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert!(
        found.contains(&ours.id) && found.contains(&older.id),
        "{found:?}"
    );
    assert!(
        !found.contains(&other.id),
        "another model's vector was compared"
    );
    // It is held all the same, for its exact keys.
    assert!(s.get(other.id).await.is_some());
}

#[tokio::test]
async fn a_load_past_the_budget_leaves_no_vector_of_an_entry_it_evicted() {
    // Each insert of a bulk load runs memory's housekeeping, which evicts earlier
    // entries of the load: their vectors must not be placed after them.
    let s = store_of(64 * 1024, SemanticIndex::new(2, IndexConfig::default()));
    let entries: Vec<Entry> = (0..2_000)
        .map(|i| {
            let mut e = entry(&format!("answer {i}"), now_ms());
            e.partition = [(i % 7) as u8; 32];
            e
        })
        .collect();
    s.load(entries, vec![], |_| {}).await;
    s.run_pending_tasks().await;
    let held = s.entry_count();
    assert!(held < 2_000, "{held} entries held within 64 KiB");
    assert!(
        s.indexed() as u64 <= held,
        "{} vectors, {held} entries",
        s.indexed()
    );
    for p in 0..7u8 {
        for c in s.search(&[p; 32], &[1.0, 0.0], 64) {
            assert!(
                s.get(c.id).await.is_some(),
                "a candidate memory does not hold"
            );
        }
    }
}

/// A change Redis refuses is tried again every `DELETE_RETRY` until Redis takes it, and given
/// up only once a deletion's mark would have lapsed (time paused: the schedule, not the clock
/// of the machine, is what is tested).
#[tokio::test(start_paused = true)]
async fn redis_changes_are_tried_again_until_taken_and_given_up_with_the_deletion_mark() {
    let start = tokio::time::Instant::now();
    let mut tries = 0;
    let taken = until_redis_takes("test", || {
        tries += 1;
        let ok = tries == 3;
        async move {
            match ok {
                true => Ok(tries),
                false => Err(RedisError::Config("down".into())),
            }
        }
    })
    .await;
    assert_eq!(taken, Some(3), "taken at the third try");
    assert_eq!(start.elapsed(), 2 * DELETE_RETRY, "two waits before it");

    let start = tokio::time::Instant::now();
    let mut tries = 0u32;
    let never: Option<()> = until_redis_takes("test", || {
        tries += 1;
        async { Err(RedisError::Config("down".into())) }
    })
    .await;
    assert_eq!(never, None);
    let waited = start.elapsed();
    assert!(
        waited < DELETED_TTL && waited + DELETE_RETRY >= DELETED_TTL,
        "given up within one retry of the mark's end: {waited:?}"
    );
    assert_eq!(
        u64::from(tries),
        DELETED_TTL.as_secs() / DELETE_RETRY.as_secs(),
        "one try every DELETE_RETRY"
    );
}
